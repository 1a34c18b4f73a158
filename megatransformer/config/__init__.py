"""Typed run configuration: one YAML file plus ``key.path=value`` overrides.

Every section is a pydantic model whose attribute docstrings are the field documentation
(``megatransformer info`` and the docs read them); the data pipeline's sections (``data``,
``objective_args``) are its own pydantic dataclasses (data_pipeline/settings.py), documented the same
way. Anything wrong with a config raises :class:`ConfigError` with one line that names the field and the
offending numbers; the CLI turns it into exit code 2.

``core`` holds what every section builds on, ``model``, ``training`` and ``run`` the sections, ``loading`` the
reading of files and overrides.
"""

from megatransformer.config.core import (
    MAX_LAYERS,
    MAX_LR,
    MAX_SEQ_LEN,
    MAX_STEPS,
    MAX_VOCAB,
    MAX_WIDTH,
    MIN_LR,
    ConfigError,
    Fraction,
    Section,
    UnitInterval,
)
from megatransformer.config.loading import (
    UniqueKeyLoader,
    apply_overrides,
    dump_config,
    load_config,
    override_value,
    precision_dtype,
    resolve_config,
    shipped_configs,
    validate,
    without_retired,
)
from megatransformer.config.model import ModelConfig, RopeScaling
from megatransformer.config.run import RunConfig
from megatransformer.config.training import (
    CheckpointConfig,
    EvalsConfig,
    OptimConfig,
    ParallelConfig,
    ProfileConfig,
    ScheduleConfig,
    SpikesConfig,
    TrainConfig,
    WandbConfig,
    WatchdogConfig,
)

__all__ = [
    "MAX_LAYERS",
    "MAX_SEQ_LEN",
    "MAX_STEPS",
    "MAX_VOCAB",
    "MAX_WIDTH",
    "MAX_LR",
    "MIN_LR",
    "CheckpointConfig",
    "ConfigError",
    "EvalsConfig",
    "Fraction",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ProfileConfig",
    "RopeScaling",
    "RunConfig",
    "ScheduleConfig",
    "Section",
    "SpikesConfig",
    "TrainConfig",
    "UniqueKeyLoader",
    "UnitInterval",
    "WandbConfig",
    "WatchdogConfig",
    "apply_overrides",
    "dump_config",
    "load_config",
    "override_value",
    "precision_dtype",
    "resolve_config",
    "shipped_configs",
    "validate",
    "without_retired",
]
