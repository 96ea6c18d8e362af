"""mdsl's version: a module of its own, importable by the modules the package's __init__ imports."""
__version__ = "0.1.0"
