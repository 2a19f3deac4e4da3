"""pathcond's version, in a module of its own: the package face, the reports and the written
files' metadata read it, and it imports nothing."""

__version__ = "0.10.3"
