"""The ReLU DAG and what is computed on it: node schema and classes (graph), one rule per node type
(rules), evaluation, rescaling groups, diag(G) and path norms (diag), the path-lifting measures
(pathlift). Imports nothing of pathcond but ``errors``."""
