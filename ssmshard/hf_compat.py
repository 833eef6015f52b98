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

# Oldest release tested (the GPU machines' image).
OLDEST_SUPPORTED = Version("5.17.0")
# First release known not to work: 5.25.0 renames Mamba-2's gated norm (MambaRMSNormGated),
# runs it through a `kernels` hub layer whose tensor_split has no sharding rule, and gives each
# Mamba layer its own lifted constants, so layer repetition no longer finds equal layers. The
# pin in pyproject.toml matches; raise it once the suite passes on the new release.
FIRST_UNSUPPORTED = Version("5.25.0")
# Newest name first: a model that accepts several (deprecated aliases) gets the current one.
CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def transformers_version() -> Version:
    import transformers

    return Version(transformers.__version__)


def check_transformers_version() -> None:
    """A clear error for a release outside the supported range, before any capture."""
    version = transformers_version()
    if not OLDEST_SUPPORTED <= version < FIRST_UNSUPPORTED:
        raise ImportError(f"ssmshard supports transformers >= {OLDEST_SUPPORTED}, < {FIRST_UNSUPPORTED}; found "
                          f"{version}: pip install 'transformers>={OLDEST_SUPPORTED},<{FIRST_UNSUPPORTED}'")


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
