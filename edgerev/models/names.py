"""The registry's names, without building anything: what a config checks ``model.arch`` against.

Importing this module imports no torch (the package loads its torch-backed names on first use), so
the daemon's config, ``edgerev daemon status`` and ``check`` stay light. The registry itself
(:func:`edgerev.models.list_models`) must list exactly these names; a test checks.
"""

ARCHS = ("irevnet", "layerwise", "resnet18", "revnet", "revnext")
