import configparser
import re
from pathlib import Path
from typing import get_args

import pytest

from kvreuse.config import (
    PRESETS,
    CacheConfig,
    ClusterConfig,
    Config,
    ConfigError,
    DiskTierConfig,
    EngineConfig,
    EventsConfig,
    ModelConfig,
    RedisTierConfig,
    SegmentConfig,
    ServerConfig,
    StructuredConfig,
    config_to_ini,
    load_config,
    parse_value,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

ARTICLE = """\
[server]
max_tokens = 2048

[cache]
enabled = true
block_size = 16
max_blocks = 4096
policy = lru
suffix.enabled = true
normalize_input = true
min_match_blocks = 1
"""

ARTICLE_ONE_LINE = (
    "[server] max_tokens = 2048 [cache] enabled = true block_size = 16 max_blocks = 4096 policy = lru "
    "suffix.enabled = true normalize_input = true min_match_blocks = 1"
)

# A value different from the default for every key, so a key that is dropped or ignored shows up.
ALL_CHANGED = Config(
    server=ServerConfig(
        max_tokens=4096,
        host="0.0.0.0",
        port=9001,
        max_queue=3,
        truncate="oldest",
        api_keys_file="/etc/kvreuse/keys 100%.txt",
        default_max_tokens=17,
        drain_timeout_s=5,
        chat_template_timeout_s=0.5,
        chat_template_max_mb=64,
        max_body_mb=8,
        max_queue_per_tenant=2,
        max_stop_strings=4,
        max_stop_chars=32,
        admin_api_keys_file="/etc/kvreuse/admin keys.txt",
    ),
    cache=CacheConfig(
        enabled=False,
        block_size=32,
        max_blocks=0,
        policy="lfu",
        sliding_kv="full",
        kv_dtype="int8",
        suffix=SegmentConfig(
            enabled=True, mode="shift", recompute_ratio=0.1, head_tokens=0, guard_margin=1.0
        ),
        normalize_input=True,
        min_match_blocks=0,
        pin_max_share=0.5,
        pin_ttl_s=0,
        session_retention_s=30.0,
        session_max_share=0.5,
        preset="eval",
        disk=DiskTierConfig(path="/var/cache/kv reuse=1", max_gb=0.25),
        redis=RedisTierConfig(url="redis://:p%40ss@127.0.0.1:6380/2", ttl_s=3600, timeout_ms=50),
        tier_queue_mb=64,
        tier_secret_file="/etc/kvreuse/tier.key",
        tier_store_tokens=True,
    ),
    model=ModelConfig(path="C:\\models\\a=b.gguf", chat_template=str(REPO_ROOT / "examples" / "gemma3-chat.jinja"),
                      tool_call_parser="hermes", served_name="my-model",
                      dtype="bf16", device="cpu", quantization="int8", weights="dense"),
    engine=EngineConfig(
        num_kv_blocks=1000, kv_cache_memory_mb=1, max_num_seqs=2, max_num_batched_tokens=16, threads=3, seed=-7,
        compile="off"
    ),
    events=EventsConfig(endpoint="tcp://127.0.0.1:6557", replay_endpoint="ipc:///tmp/kv replay", topic="kv",
                        buffer_steps=5),
    cluster=ClusterConfig(replicas=3, routing="round_robin", ray_address="ray://10.0.0.1:10001",
                          cpus_per_replica=0.5, cache_threshold=0.5, balance_abs_threshold=8,
                          balance_rel_threshold=2.0),
    structured=StructuredConfig(max_schema_bytes=1000, max_schema_properties=20, compile_timeout_s=0.5,
                                grammar_cache_mb=8),
)


def write(tmp_path, text, name="kvreuse.ini"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


def test_article_ini_loads_exactly(tmp_path):
    config = load_config(write(tmp_path, ARTICLE))
    assert config.server.max_tokens == 2048
    assert config.cache.enabled is True
    assert config.cache.block_size == 16
    assert config.cache.max_blocks == 4096
    assert config.cache.policy == "lru"
    assert config.cache.suffix.enabled is True
    assert config.cache.normalize_input is True  # default is False, so this proves the file was read
    assert config.cache.min_match_blocks == 1
    expected = Config(cache=CacheConfig(normalize_input=True, suffix=SegmentConfig(enabled=True)))
    assert config == expected
    assert load_config(Path(__file__).resolve().parents[1] / "examples" / "article.ini") == expected  # as shipped


def test_article_one_line_form_matches_multi_line(tmp_path):
    multi = load_config(write(tmp_path, ARTICLE, "multi.ini"))
    one = load_config(write(tmp_path, ARTICLE_ONE_LINE + "\n", "one.ini"))
    assert one == multi
    assert one.cache.normalize_input is True


def test_one_line_form_reads_every_pair(tmp_path):
    text = (
        "# comment\n"
        "[server] max_tokens=4096 port = 9000 [cache] block_size = 32 suffix.mode = shift  # tail\n"
    )
    config = load_config(write(tmp_path, text))
    assert config.server.max_tokens == 4096
    assert config.server.port == 9000
    assert config.cache.block_size == 32
    assert config.cache.suffix.mode == "shift"


def test_one_line_form_mixed_with_normal_lines_keeps_line_numbers(tmp_path):
    text = "[server] max_tokens = 4096 port = 9000\nhost = ::1\n[cache]\npolicy = lfu\n"
    config = load_config(write(tmp_path, text))
    assert (config.server.max_tokens, config.server.port, config.server.host) == (4096, 9000, "::1")
    assert config.cache.policy == "lfu"
    path = write(tmp_path, "[server] max_tokens = 4096 port = 9000\n[cache]\nblock_size\n")
    assert error_of(path).startswith(f"malformed config file {path}, line 3: ")


def test_one_line_form_rejects_unsplittable_text(tmp_path):
    path = write(tmp_path, "[cache] block_size = 16 junk\n")
    assert error_of(path) == f"malformed config file {path}, line 1: expected key = value, got 'junk'"


def test_defaults_without_file():
    config = load_config()
    assert config == Config()
    assert config.server.max_tokens == 2048
    assert config.cache.suffix.recompute_ratio == 0.15
    assert config.engine.num_kv_blocks == 0


@pytest.mark.parametrize("config", [Config(), ALL_CHANGED], ids=["defaults", "all-changed"])
def test_config_to_ini_round_trips(tmp_path, config):
    text = config_to_ini(config)
    assert load_config(write(tmp_path, text)) == config


def test_all_changed_differs_from_defaults_everywhere():
    changed, default = ALL_CHANGED.as_dict(), Config().as_dict()
    for section, values in default.items():
        for key, value in values.items():
            if isinstance(value, dict):  # suffix.*, disk.*, redis.*
                for sub, sub_value in value.items():
                    assert changed[section][key][sub] != sub_value, f"{section}.{key}.{sub}"
            else:
                assert changed[section][key] != value, f"{section}.{key}"


def test_config_to_ini_writes_every_key():
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(config_to_ini(Config()))
    assert parser.sections() == ["server", "cache", "model", "engine", "events", "cluster", "structured"]
    assert set(parser["cache"]) == {
        "enabled", "block_size", "max_blocks", "policy", "sliding_kv", "kv_dtype", "normalize_input",
        "min_match_blocks", "pin_max_share", "pin_ttl_s", "session_retention_s", "session_max_share", "preset",
        "suffix.enabled", "suffix.mode", "suffix.recompute_ratio", "suffix.head_tokens",
        "suffix.guard_margin", "disk.path", "disk.max_gb", "redis.url", "redis.ttl_s", "redis.timeout_ms",
        "tier_queue_mb", "tier_secret_file", "tier_store_tokens",
    }
    assert len(parser["server"]) == 15 and len(parser["model"]) == 8 and len(parser["engine"]) == 7
    assert len(parser["events"]) == 4 and len(parser["cluster"]) == 7 and len(parser["structured"]) == 4


def test_article_round_trips_after_overrides(tmp_path):
    overrides = ["cache.block_size=32", "cache.suffix.enabled=false", "server.max_tokens=4096",
                 "cache.suffix.recompute_ratio=0.3", "model.path=/tmp/m.gguf"]
    config = load_config(write(tmp_path, ARTICLE, "article.ini"), overrides)
    again = load_config(write(tmp_path, config_to_ini(config), "again.ini"))
    assert again == config
    assert (again.cache.block_size, again.cache.suffix.enabled, again.server.max_tokens) == (32, False, 4096)
    assert again.cache.suffix.recompute_ratio == 0.3
    assert again.model.path == "/tmp/m.gguf"
    assert again.cache.normalize_input is True


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = write(tmp_path, "[cache]\nblock_size = 32\npolicy = lfu\n[engine]\nseed = 5\n")
    config = load_config(path, ["cache.block_size=64", "engine.max_num_seqs=4"])
    assert config.cache.block_size == 64  # CLI over file
    assert config.cache.policy == "lfu"  # file over default
    assert config.engine.seed == 5
    assert config.engine.max_num_seqs == 4  # CLI over default
    assert config.cache.max_blocks == 4096  # default
    assert load_config(path).cache.block_size == 32


def test_later_override_wins_and_validation_is_at_the_end(tmp_path):
    assert load_config(None, ["cache.block_size=8", "cache.block_size=128"]).cache.block_size == 128
    # An out-of-range file value is fine when an override replaces it before validation.
    path = write(tmp_path, "[cache]\nblock_size = 0\n")
    assert load_config(path, ["cache.block_size=4"]).cache.block_size == 4


def test_keys_are_case_insensitive_and_comments_and_bom_are_accepted(tmp_path):
    path = tmp_path / "bom.ini"
    path.write_text("\ufeff; a comment\n[cache]\n# another\nBlock_Size = 64\n\n", encoding="utf-8")
    assert load_config(path).cache.block_size == 64
    assert load_config(None, ["cache.Block_Size=8"]).cache.block_size == 8


@pytest.mark.parametrize("text,expected", [
    ("true", True), ("TRUE", True), ("yes", True), ("On", True), ("1", True),
    ("false", False), ("No", False), ("off", False), ("0", False), (" FALSE ", False),
])
def test_bool_spellings(text, expected):
    assert parse_value("cache.enabled", text, bool) is expected
    assert load_config(None, [f"cache.suffix.enabled={text}"]).cache.suffix.enabled is expected


def test_parse_value_conversions():
    assert parse_value("x.y", "16", int) == 16
    assert parse_value("x.y", "-3", int) == -3
    assert parse_value("x.y", "0.5", float) == 0.5
    assert parse_value("x.y", "1", float) == 1.0
    assert parse_value("x.y", "some text", str) == "some text"
    with pytest.raises(ConfigError, match="must be an integer, got '16.5'"):
        parse_value("x.y", "16.5", int)


@pytest.mark.parametrize("override,message", [
    ("cache.block_size=sixteen", "config key 'cache.block_size' must be an integer, got 'sixteen'"),
    ("cache.block_size=16.5", "config key 'cache.block_size' must be an integer, got '16.5'"),
    ("server.port=", "config key 'server.port' must be an integer, got ''"),
    ("cache.enabled=maybe", "config key 'cache.enabled' must be a boolean (true/false), got 'maybe'"),
    ("cache.suffix.enabled=2", "config key 'cache.suffix.enabled' must be a boolean (true/false), got '2'"),
    ("cache.suffix.recompute_ratio=lots",
     "config key 'cache.suffix.recompute_ratio' must be a number, got 'lots'"),
    ("cache.suffix.guard_margin=nan", "config key 'cache.suffix.guard_margin' must be a number, got 'nan'"),
    ("cache.block_size=0", "config key 'cache.block_size' must be between 1 and 256, got 0"),
    ("cache.block_size=257", "config key 'cache.block_size' must be between 1 and 256, got 257"),
    ("server.port=65536", "config key 'server.port' must be between 0 and 65535, got 65536"),
    ("server.max_tokens=4", "config key 'server.max_tokens' must be >= 16, got 4"),
    ("server.max_tokens=1000001", "config key 'server.max_tokens' must be <= 1000000, got 1000001"),
    ("cache.max_blocks=-1", "config key 'cache.max_blocks' must be >= 0, got -1"),
    ("cache.suffix.recompute_ratio=1.5",
     "config key 'cache.suffix.recompute_ratio' must be between 0.0 and 1.0, got 1.5"),
    ("cache.suffix.guard_margin=-0.1",
     "config key 'cache.suffix.guard_margin' must be between 0.0 and 100.0, got -0.1"),
    ("engine.max_num_batched_tokens=0", "config key 'engine.max_num_batched_tokens' must be >= 1, got 0"),
    ("cache.policy=fifo", "config key 'cache.policy' must be one of lru, lfu, s3fifo, chain, learned, got 'fifo'"),
    ("model.dtype=fp16", "config key 'model.dtype' must be one of auto, fp32, bf16, got 'fp16'"),
    ("server.truncate=newest", "config key 'server.truncate' must be one of error, oldest, got 'newest'"),
    ("cache.blok_size=32", "unknown config key 'cache.blok_size'; did you mean 'cache.block_size'?"),
    ("cache.suffix.enabeld=true",
     "unknown config key 'cache.suffix.enabeld'; did you mean 'cache.suffix.enabled'?"),
    ("model.zzz=1", "unknown config key 'model.zzz'; valid keys: chat_template, device, dtype, path, quantization, "
                    "served_name, tool_call_parser, weights"),
    ("cachee.block_size=16",
     "unknown config section [cachee] in --set 'cachee.block_size=16'; did you mean [cache]? "
     "valid sections: cache, cluster, engine, events, model, server, structured"),
])
def test_bad_override_values(override, message):
    assert error_of(None, [override]) == message


def test_bound_values_are_accepted():
    config = load_config(None, [
        "cache.block_size=1", "server.port=65535", "server.max_tokens=16", "server.max_tokens=1000000",
        "cache.suffix.recompute_ratio=0", "cache.max_blocks=0",
    ])
    assert (config.cache.block_size, config.server.port, config.server.max_tokens) == (1, 65535, 1_000_000)
    assert config.cache.suffix.recompute_ratio == 0.0


@pytest.mark.parametrize(
    "override", ["cache.block_size", "block_size=16", "=16", ".block_size=1", "cache.=1", ""]
)
def test_bad_override_syntax(override):
    assert error_of(None, [override]) == f"bad --set {override!r}: expected section.key=value"


def test_bad_override_syntax_message_text():
    assert error_of(None, ["cache.block_size"]) == "bad --set 'cache.block_size': expected section.key=value"


def test_unknown_section_in_file(tmp_path):
    path = write(tmp_path, "[cachee]\nblock_size = 16\n")
    valid = "valid sections: cache, cluster, engine, events, model, server, structured"
    assert error_of(path) == f"unknown config section [cachee] in {path}; did you mean [cache]? {valid}"
    path = write(tmp_path, "[zzz]\n")
    assert error_of(path) == f"unknown config section [zzz] in {path}; {valid}"


def test_default_section_is_not_special(tmp_path):
    path = write(tmp_path, "[DEFAULT]\nblock_size = 16\n[cache]\n")
    assert error_of(path).startswith(f"unknown config section [DEFAULT] in {path}")


def test_unknown_key_and_bad_value_in_file(tmp_path):
    assert error_of(write(tmp_path, "[cache]\nblok_size = 16\n")) == (
        "unknown config key 'cache.blok_size'; did you mean 'cache.block_size'?"
    )
    assert error_of(write(tmp_path, "[cache]\nblock_size = sixteen\n")) == (
        "config key 'cache.block_size' must be an integer, got 'sixteen'"
    )
    assert error_of(write(tmp_path, "[server]\nmax_tokens = 4\n")) == (
        "config key 'server.max_tokens' must be >= 16, got 4"
    )


def test_missing_file(tmp_path):
    path = tmp_path / "nope.ini"
    assert error_of(path) == f"config file not found: {path}"
    assert error_of(str(path)) == f"config file not found: {path}"


@pytest.mark.parametrize("text,line,detail", [
    ("[cache]\nblock_size\n", 2, "expected key = value or [section], got 'block_size'"),
    ("[cache]\n[server\nport = 1\n", 2, "expected key = value or [section], got '[server'"),
    ("[cache\nblock_size = 16\n", 1, "expected a [section] header, got '[cache'"),
    ("block_size = 16\n[cache]\n", 1, "expected a [section] header, got 'block_size = 16'"),
    ("[cache]\nblock_size = 16\n\nblock_size = 32\n", 4, "key 'cache.block_size' is set twice"),
    ("[cache]\n[server]\n[cache]\n", 3, "section [cache] appears twice"),
])
def test_malformed_ini(tmp_path, text, line, detail):
    path = write(tmp_path, text)
    assert error_of(path) == f"malformed config file {path}, line {line}: {detail}"


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_code_built_configs_are_checked_when_built():
    assert Config(**ALL_CHANGED.model_dump()) == ALL_CHANGED
    with pytest.raises(ConfigError, match=r"^config key 'cache.block_size' must be an integer, got '16'$"):
        Config(cache=CacheConfig(block_size="16"))
    with pytest.raises(ConfigError, match=r"^config key 'server.port' must be an integer, got True$"):
        Config(server=ServerConfig(port=True))
    with pytest.raises(ConfigError, match=r"must be between 0.0 and 1.0, got 2$"):
        Config(cache=CacheConfig(suffix=SegmentConfig(recompute_ratio=2)))


def test_as_dict():
    data = load_config(None, ["cache.suffix.mode=shift"]).as_dict()
    assert data["cache"]["suffix"] == {"enabled": False, "mode": "shift", "recompute_ratio": 0.15,
                                       "head_tokens": 8, "guard_margin": 0.03}
    assert data["server"]["max_tokens"] == 2048
    assert set(data) == {"server", "cache", "model", "engine", "events", "cluster", "structured"}


def test_presets_set_the_article_advice_and_explicit_keys_override_them(tmp_path):
    eval_preset = load_config(None, ["cache.preset=eval"]).cache
    assert (eval_preset.block_size, eval_preset.policy) == (32, "learned")
    assert eval_preset.suffix.enabled and eval_preset.suffix.guard_margin == 0
    agent = load_config(None, ["cache.preset=agent"]).cache
    assert agent.normalize_input and agent.suffix.enabled and agent.suffix.recompute_ratio == 0.1
    rag = load_config(None, ["cache.preset=rag"]).cache
    assert rag.suffix.enabled and rag.suffix.recompute_ratio == 0.3
    path = tmp_path / "kvreuse.ini"
    # An explicit key wins over the preset whether it comes before or after it, in the file or on the CLI.
    path.write_text("[cache]\nblock_size = 64\npreset = eval\n")
    config = load_config(path)
    assert (config.cache.preset, config.cache.block_size, config.cache.policy) == ("eval", 64, "learned")
    config = load_config(path, ["cache.preset=chat", "cache.policy=lfu"])
    assert (config.cache.preset, config.cache.block_size, config.cache.policy) == ("chat", 64, "lfu")
    assert error_of(None, ["cache.preset=fast"]) == (
        "config key 'cache.preset' must be one of none, chat, eval, agent, rag, got 'fast'")


@pytest.mark.parametrize("text", ["t", "f", "y", "n", "2", ""])
def test_only_configparser_bool_spellings_are_accepted(text):
    assert error_of(None, [f"cache.enabled={text}"]) == (
        f"config key 'cache.enabled' must be a boolean (true/false), got {text!r}")


def test_preset_choices_are_the_preset_names():
    assert get_args(CacheConfig.model_fields["preset"].annotation) == tuple(PRESETS)


def test_suffix_settings_are_immutable_and_with_changes_revalidates():
    settings = load_config(None, ["cache.preset=rag"]).cache.suffix
    changed = settings.with_changes(recompute_ratio=1.0, mode="shift")
    assert (changed.recompute_ratio, changed.mode, changed.enabled) == (1.0, "shift", True)
    assert (settings.recompute_ratio, settings.mode) == (0.3, "blend")
    assert settings.with_changes() == settings and hash(settings.with_changes()) == hash(settings)
    with pytest.raises(ConfigError, match=r"^config key 'cache.suffix.recompute_ratio' must be between 0.0 and 1.0, "
                                          r"got 1.5$"):
        settings.with_changes(recompute_ratio=1.5)
    with pytest.raises(ConfigError, match=r"^config key 'cache.suffix.mode' must be one of blend, shift, got 'x'$"):
        settings.with_changes(mode="x")
    with pytest.raises(ConfigError, match=r"^unknown config key 'cache.suffix.mdoe'; did you mean 'cache.suffix.mode'"):
        settings.with_changes(mdoe="shift")
    with pytest.raises(ConfigError, match=r"^config key 'cache.suffix.mode' is read-only"):
        settings.mode = "shift"
    assert settings.mode == "blend"


def test_code_built_configs_are_checked_when_assigned_copied_or_built_from_dicts():
    config = Config()
    with pytest.raises(ConfigError, match=r"^config key 'cache.block_size' must be between 1 and 256, got 0$"):
        config.cache.block_size = 0
    assert config.cache.block_size == 16
    sized = config.with_changes(cache=config.cache.with_changes(block_size=64))
    assert (sized.cache.block_size, config.cache.block_size) == (64, 16)
    assert sized.server == config.server and sized.server is not config.server  # a copy: no shared sections
    with pytest.raises(ConfigError, match=r"^config key 'engine.max_num_seqs' must be >= 1, got 0$"):
        config.engine.with_changes(max_num_seqs=0)
    with pytest.raises(ConfigError, match=r"^config key 'cache.suffix.guard_margin' must be a number, got inf$"):
        Config(cache={"suffix": {"guard_margin": float("inf")}})
    with pytest.raises(ConfigError, match=r"^unknown config key 'cache.blok_size'; did you mean 'cache.block_size'"):
        CacheConfig(blok_size=32)


@pytest.mark.parametrize("setting, message", [
    ("cache.disk.path={file}", "config key 'cache.disk.path': the disk tier needs a directory"),
    ("cache.redis.url=redis://localhost:notaport/0", "config key 'cache.redis.url': not a Redis URL"),
    ("cache.redis.url=redis://localhost:6379/zero",
     "config key 'cache.redis.url': the database 'zero' is not a number"),
], ids=["disk-path-is-a-file", "redis-port-not-a-number", "redis-db-not-a-number"])
def test_a_tier_that_cannot_work_is_a_config_error_with_exit_2_before_the_model_loads(tmp_path, setting, message):
    import subprocess
    import sys

    file = tmp_path / "a-file"
    file.write_text("")
    setting = setting.format(file=file)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [setting])
    # A model that does not exist would be the error if the model were looked at first.
    done = subprocess.run([sys.executable, "-m", "kvreuse", "serve", "--model", str(tmp_path / "no-model"),
                           "--set", setting], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, (done.returncode, done.stderr)


@pytest.mark.parametrize("sets,message", [
    (["model.weights=gguf", "model.quantization=int4"], "model.weights = gguf reads the file's own blocks and "
                                                         "model.quantization = int4 re-quantizes"),
    (["model.weights=gguf", "model.path=/models/llama-dir"], "model.weights = gguf needs a .gguf model"),
    (["model.weights=fast"], "model.weights' must be one of auto, gguf, dense"),
])
def test_weights_that_cannot_apply_are_refused_by_name(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, sets)
