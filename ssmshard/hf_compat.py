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
"""

from __future__ import annotations

import inspect

from packaging.version import Version

# Oldest release tested (the GPU machines' image); the newest is whatever pip resolves.
OLDEST_SUPPORTED = Version("5.17.0")
# Newest name first: a model that accepts several (deprecated aliases) gets the current one.
CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def transformers_version() -> Version:
    import transformers

    return Version(transformers.__version__)


def check_transformers_version() -> None:
    """A clear error for a release older than the supported range."""
    version = transformers_version()
    if version < OLDEST_SUPPORTED:
        raise ImportError(f"ssmshard needs transformers >= {OLDEST_SUPPORTED}, found {version}; "
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
