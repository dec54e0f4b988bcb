import configparser

from kvreuse import config_reference
from kvreuse.config import PRESET_DESCRIPTIONS, PRESETS, Config, config_to_ini
from kvreuse.config_reference import DOC_PATH, REGENERATE, choices, keys, render


def _row(text: str, section: str, key: str) -> str:
    """The table row of `key` (as written in its INI section) under the `## [section]` heading."""
    part = text.split(f"\n## [{section}]\n", 1)[1].split("\n## ", 1)[0]
    [row] = [line for line in part.splitlines() if line.startswith(f"| `{key}` |")]
    return row


def test_docs_configuration_md_is_current():
    assert DOC_PATH.read_text(encoding="utf-8") == render(), (
        f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`")


def test_every_field_has_a_description():
    def walk(model, where):
        for name, field in model.model_fields.items():
            assert (field.description or "").strip(), f"{where}{name} has no description"
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                walk(field.annotation, f"{where}{name}.")
    walk(Config, "")


def test_every_key_is_documented_with_its_default_and_every_literal_choice():
    text = render()
    defaults = configparser.ConfigParser(interpolation=None)
    defaults.read_string(config_to_ini(Config()))  # the defaults as an INI file writes them
    documented = 0
    for section, field in Config.model_fields.items():
        for key, leaf in keys(field.annotation):
            row = _row(text, section, key)
            assert f"| `{defaults[section][key] or chr(34) * 2}` |" in row, f"{section}.{key}: default missing"
            for choice in choices(leaf) or ():
                assert f"`{choice}`" in row, f"{section}.{key}: choice {choice!r} missing"
            documented += 1
    assert documented == sum(len(defaults[section]) for section in defaults.sections())
    assert documented == text.count("\n| `") - len(PRESETS)  # no row without a key, no key twice


def test_bounds_come_from_the_field_constraints():
    text = render()
    assert "| >= 1, <= 256 |" in _row(text, "cache", "block_size")
    assert "| >= 0.0, <= 1.0 |" in _row(text, "cache", "suffix.recompute_ratio")
    assert "| > 0.0 |" in _row(text, "cache", "disk.max_gb")
    assert "| >= 16 |" in _row(text, "server", "max_tokens")


def test_presets_are_listed_with_their_keys_and_purpose():
    assert PRESET_DESCRIPTIONS.keys() == PRESETS.keys()
    presets = render().split("\n## Presets\n", 1)[1]
    for preset, values in PRESETS.items():
        [row] = [line for line in presets.splitlines() if line.startswith(f"| `{preset}` |")]
        assert PRESET_DESCRIPTIONS[preset] in row
        for key, value in values.items():
            assert f"`{key} = {value}`" in row


def test_main_prints_or_writes_the_reference(tmp_path, capsys):
    config_reference.main([])
    assert capsys.readouterr().out == render()
    target = tmp_path / "configuration.md"
    config_reference.main(["--write", str(target)])
    assert target.read_text(encoding="utf-8") == render()
