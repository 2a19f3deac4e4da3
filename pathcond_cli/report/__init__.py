"""What a run tells people and pipelines: the JSON documents, rich tables, plots. Imports the library
(``analysis``, ``rescaling``, ``statistics``, ``toolkit``), ``engine``, ``solve``, ``io`` and
``errors``, never ``cli``."""
