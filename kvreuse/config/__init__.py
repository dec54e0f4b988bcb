"""Configuration: pydantic models loaded from an INI file plus ``--set section.key=value`` overrides.

Types, ranges and choices live in the field declarations (`sections.py`); pydantic's first error becomes a
ConfigError whose one sentence names the key (`messages.py`); the INI is read and written in `ini.py`, the scenario
presets are in `presets.py`. The package sits on the ground floor: it imports nothing of kvreuse's but itself and
`extras`, so every layer above (the model included) may read it."""

from kvreuse.config.ini import config_to_ini, load_config, parse_value
from kvreuse.config.messages import ConfigError
from kvreuse.config.presets import PRESET_DESCRIPTIONS, PRESETS
from kvreuse.config.sections import (
    MAX_PIN_TTL_S,
    CacheConfig,
    ClusterConfig,
    Config,
    DiskTierConfig,
    EngineConfig,
    EventsConfig,
    ModelConfig,
    RedisTierConfig,
    SegmentConfig,
    ServerConfig,
    StructuredConfig,
)

__all__ = [
    "MAX_PIN_TTL_S", "PRESETS", "PRESET_DESCRIPTIONS", "CacheConfig", "ClusterConfig", "Config", "ConfigError",
    "DiskTierConfig", "EngineConfig", "EventsConfig", "ModelConfig", "RedisTierConfig", "SegmentConfig",
    "ServerConfig", "StructuredConfig", "config_to_ini", "load_config", "parse_value",
]
