"""The one place the version is written: pyproject.toml reads it (``[tool.setuptools.dynamic]``),
and shim/Makefile passes it to the C compiler (the shim's ``mucudnn_version()``). Keep the
line's form ``__version__ = "X"``: the Makefile reads it with sed, without Python."""

__version__ = "0.1.0"
