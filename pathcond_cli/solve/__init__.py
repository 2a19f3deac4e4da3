"""Finding the rescaling: the objective F on diag(G), its curvature, the layer-shift start, the solvers,
the log-scale bound and the storage check, the ENorm criterion. Imports ``engine`` and ``errors``."""
