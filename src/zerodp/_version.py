"""The package version, in a module of its own so that modules inside the package can name it
without importing ``zerodp`` itself (which imports them)."""
__version__ = "0.1.0"
