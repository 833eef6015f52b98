"""What differs between the transformers releases ssmshard supports, in one place.

ssmshard captures Hugging Face modeling code as it runs, so every name it passes to that code
or reads back from it is a contract with a release. The supported range is
``SUPPORTED_TRANSFORMERS`` (the oldest release is what the GPU machines run; CI tests the
oldest and the newest). What moved inside that range:

* The cache keyword and output field. Up to 5.23 Mamba-1/2 take ``cache_params`` and the
  others ``past_key_values``; from 5.24 every family takes ``cache`` and the old names are
  deprecated aliases (to be removed in 5.40). Passing an alias the model forwards into
  ``**kwargs`` instead of its cache argument does not fail: the model quietly starts a new
  cache, and a decode step becomes a prefill. So the name is read from the signature, never
  assumed, and an unknown signature is an error.
* The kernel entry points. From 5.25 the mixers call per-layer wrappers (``*_scan_forward``,
  ``causal_conv1d_forward``) that read and write the cache and call the module-level kernel
  functions the shims replace (``hf_shims``); the wrappers split off the tokens whose states a
  recording cache keeps, which capture folds away (``passes/canonicalize.py``). Mamba-2's gated
  norm is ``Mamba2RMSNormGated`` (``MambaRMSNormGated`` before); the shims take any
  ``*RMSNormGated`` class of the modeling module.
* The cache's token counter. From 5.25 each SSM cache layer counts tokens in a tensor of its
  own, bumped in place by every mixer; programs never read it and capture drops the writes
  (``Program.from_exported``).
"""

from __future__ import annotations

import inspect

from packaging.version import Version

# Oldest release tested (the GPU machines' image).
OLDEST_SUPPORTED = Version("5.17.0")
# Newest name first: a model that accepts several (deprecated aliases) gets the current one.
CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def transformers_version() -> Version:
    import transformers

    return Version(transformers.__version__)


def check_transformers_version() -> None:
    """A clear error for a release outside the supported range, before any capture."""
    version = transformers_version()
    if version < OLDEST_SUPPORTED:
        raise ImportError(f"ssmshard supports transformers >= {OLDEST_SUPPORTED}; found {version}: "
                          f"pip install 'transformers>={OLDEST_SUPPORTED}'")


def cache_kwarg(model) -> str:
    """The keyword under which ``model.forward`` takes its cache (see the module docstring)."""
    params = inspect.signature(model.forward).parameters
    for name in CACHE_KWARGS:
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes none of {CACHE_KWARGS} (transformers "
                    f"{transformers_version()}): ssmshard does not know where this release passes the cache. "
                    f"Supported: transformers >= {OLDEST_SUPPORTED}; please report the version.")


def output_cache(output, model):
    """The cache object of a model output (the field is named like the keyword)."""
    return getattr(output, cache_kwarg(model))
