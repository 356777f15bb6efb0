"""Host packaging: a source model in, one signed bundle per target out.

Layers, each a module: ``request`` (``PackageRequest``, what the API and the CLI both build),
``orchestrate`` (the run: arguments, data, each target through the optimisation engine, the
fallback chain, timings), ``data`` (calibration and evaluation data, ``--compress``), ``gate``
(the validation gate and golden vectors), ``assemble`` (manifests and bundle files) and ``result``
(what a run answers). ``import edgekit.packaging`` loads nothing heavy.
"""

from __future__ import annotations

from edgekit.packaging.request import PackageRequest

__all__ = ["PackageRequest"]
