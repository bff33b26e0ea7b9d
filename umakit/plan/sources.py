"""Where `umakit plan` gets a config.json: a model directory, a GGUF file, a preset, a file, or the built-in model."""

from __future__ import annotations

import json
from pathlib import Path

from umakit.checkpoint.default import DEFAULT_MODEL_NAME
from umakit.errors import ConfigError, InvalidArgumentError, ModelNotFoundError
from umakit.core.home import umakit_home

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "smollm2-135m"


def resolve_config(model: str | None = None, preset: str | None = None, config: str | None = None) -> tuple[str, dict]:
    """(display name, config dict) from exactly one of: a model directory (or preset name), a preset, a config.json.
    None of them: the built-in model as imported (its real quantization), else its preset's shapes."""
    given = [x for x in (model, preset, config) if x is not None]
    imported = umakit_home() / "models" / DEFAULT_MODEL_NAME  # where default_model_dir() imports it
    if not given and (imported / "config.json").is_file():
        return DEFAULT_MODEL_NAME, load_config(imported)
    if len(given) > 1:
        raise InvalidArgumentError("give only one of MODEL, --preset and --config")
    if config is not None:
        path = Path(config)
        return (path.parent.resolve().name if path.name == "config.json" else path.stem), load_config(path)
    if model is not None and not Path(model).exists() and model.lower() in list_presets():
        preset = model
    if model is not None and preset is None:
        return Path(model).resolve().name, load_config(model)
    preset = preset or DEFAULT_PRESET
    return preset.lower(), load_preset(preset)


def list_presets() -> list[str]:
    """Names of the built-in config shapes (umakit/plan/presets/*.json)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    """The config.json of a built-in preset such as "llama-3-8b"."""
    path = PRESET_DIR / f"{name.lower()}.json"
    if not path.is_file():
        raise ModelNotFoundError(f"unknown preset {name!r}; choose from {', '.join(list_presets())}")
    return json.loads(path.read_text(encoding="utf-8"))


def load_config(path: str | Path) -> dict:
    """A config.json file, the config.json inside a model directory, or the config.json `umakit import` writes for
    a GGUF file (its quantization from the file's tensor types)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from umakit.checkpoint.gguf.convert import import_config, plan_import
        from umakit.checkpoint.gguf.reader import open_gguf

        return import_config(plan_import(open_gguf(path)))
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} not found: give a model directory with config.json, --config FILE or --preset NAME"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config
