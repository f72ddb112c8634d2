"""The flexdemo application: the ``flexdemo`` command, the trainer, configs, the bench and its
plots, and the training tasks. It uses the library (:mod:`flexdemo`) and the tools
(:mod:`flexdemo.tools`); the library never imports it."""

# the application's modules are imported by name (flexdemo.app.train.trainer, ...)
__all__: list[str] = []
