"""slime's command-line flags, each with this project's answer, and slime's --custom-config-path.

`slime_flags.toml` (beside this module) lists every flag of slime's, at the commit it names, as honoured, accepted or
refused. This project's parser declares an honoured flag with slime's meaning. A flag declared as a typed config's
field carries its slime name there instead (`declared_in_fields`). An accepted flag is declared here, and only the
value this project runs with anyway passes. A refused flag is declared here so that a slime command line parses, and
is refused with why and what instead.

`add_slime_flags` declares the accepted and refused ones and --custom-config-path. `apply_slime_flags` runs once after
parsing. It merges the --custom-config-path YAML onto the flags, overriding the command line as slime does. Each key is
converted and checked as its flag would be. Then it refuses what the file says to refuse. Errors are ValueErrors whose
message names the flag (or the YAML key and file): the CLI turns them into usage errors (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).resolve().with_name("slime_flags.toml")


def integer(text: str) -> int:
    return int(text)


def number(text: str) -> float:
    return float(text)


def json_value(text: str) -> Any:
    return json.loads(text)


# how an accepted flag's value is read from the command line (its `kind` in the data file); switch and bool take none
CONVERTERS = {"int": integer, "float": number, "str": str, "json": json_value}


def dest_of(name: str) -> str:
    """argparse's attribute for a flag without dest=: --eval-input-key -> eval_input_key."""
    return name.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class SlimeFlag:
    name: str
    answer: str  # honoured | accepted | refused
    dest: str  # slime's attribute for the flag (the --custom-config-path key)
    kind: str = "switch"  # accepted: switch, bool (--x / --no-x), int, float, str or json
    values: tuple = ()  # accepted: the values this project runs with ...
    same_as: str | None = None  # ... or the value of this flag of ours ...
    same_as_env: str | None = None  # ... or of this environment variable (never shown: it may be a secret)
    why: str = ""
    instead: str = ""

    def declaration(self) -> dict[str, Any]:
        """add_argument's keywords: hidden from --help, absent from the parsed flags unless given."""
        common = {"dest": self.dest, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if self.answer == "refused":  # any number of values, so that whatever slime takes parses and reaches the check
            return {**common, "nargs": "*"}
        if self.kind == "switch":
            return {**common, "action": "store_const", "const": True}
        if self.kind == "bool":
            return {**common, "action": argparse.BooleanOptionalAction}
        return {**common, "type": CONVERTERS[self.kind]}

    def problem(self, value: Any, args: argparse.Namespace) -> str | None:
        """Why `value` of this flag cannot be taken here (naming the flag, saying what to use instead), or None."""
        if self.answer == "refused":
            return f"{self.name} is not supported here: {self.why}; {self.instead}"
        if self.kind == "switch" and not value:  # false from a YAML file: not given
            return None
        if self.same_as is not None:
            other = getattr(args, dest_of(self.same_as))
            if self.kind in ("switch", "bool") and bool(value) != bool(other):
                given = self.name if value else "--no-" + self.name.removeprefix("--")
                return f"{given} {'without' if value else 'with'} {self.same_as}: {self.why}; {self.instead}"
            if self.kind not in ("switch", "bool") and value != other:
                return f"{self.name} {value!r} differs from {self.same_as} {other!r}: {self.why}; {self.instead}"
            return None
        if self.same_as_env is not None:
            if value != os.environ.get(self.same_as_env):
                return f"{self.name} is not the key in ${self.same_as_env}: {self.why}; {self.instead}"
            return None
        if self.values and value not in self.values:
            accepted = " or ".join(json.dumps(v) if self.kind == "json" else str(v) for v in self.values)
            return f"{self.name} {value!r}: {self.why} (accepted here: {accepted}); {self.instead}"
        return None


@dataclass(frozen=True)
class Vocabulary:
    slime_commit: str
    flags: dict[str, SlimeFlag]  # by name
    tis_keys: dict[str, dict[str, Any]]  # what slime's TIS/MIS helper reads from args: {type, choices, nullable}

    def answered(self, answer: str) -> list[SlimeFlag]:
        return [flag for flag in self.flags.values() if flag.answer == answer]

    def by_dest(self, dest: str) -> SlimeFlag | None:
        return next((flag for flag in self.flags.values() if flag.dest == dest), None)


def declared_in_fields() -> list[str]:
    """slime's names that the typed configs' flag fields carry (each declared once, as its field): honoured."""
    from slime_search.config.checkpoints import CheckpointConfig
    from slime_search.config.cluster import ClusterConfig
    from slime_search.config.engines import EngineConfig
    from slime_search.config.logs import LogConfig
    from slime_search.config.loss import LossConfig
    from slime_search.config.model import ModelArgs
    from slime_search.config.optim import OptimConfig
    from slime_search.config.rollout import DataConfig, RolloutConfig, RolloutManagerConfig, SamplingConfig
    from slime_search.config.training import ImportanceWeightsConfig, TrainingConfig
    from slime_search.evaluation.flags import EvalConfig
    from slime_search.utils.flag_fields import slime_flag_names

    return slime_flag_names(
        [
            CheckpointConfig,
            ClusterConfig,
            EngineConfig,
            DataConfig,
            RolloutConfig,
            SamplingConfig,
            RolloutManagerConfig,
            TrainingConfig,
            ImportanceWeightsConfig,
            LossConfig,
            OptimConfig,
            EvalConfig,
            LogConfig,
            ModelArgs,
        ]
    )


@cache
def vocabulary() -> Vocabulary:
    data = tomllib.loads(DATA_FILE.read_text())
    dests = data.get("slime_dests", {})
    flags: dict[str, SlimeFlag] = {}

    def add(flag: SlimeFlag) -> None:
        if flag.name in flags:
            raise ValueError(f"{DATA_FILE}: {flag.name} has two answers")
        flags[flag.name] = flag

    for name in [*data["honoured"], *declared_in_fields()]:
        add(SlimeFlag(name, "honoured", dests.get(name, dest_of(name))))
    for answer in ("accepted", "refused"):
        for name, entry in data[answer].items():
            fields = {**entry, "values": tuple(entry.get("values", ()))}
            add(SlimeFlag(name, answer, dests.get(name, dest_of(name)), **fields))
    return Vocabulary(data["slime_commit"], flags, data["tis_keys"])


def add_slime_flags(parser: argparse.ArgumentParser) -> None:
    """--custom-config-path, and slime's accepted and refused flags (hidden; listed in the data file)."""
    vocab = vocabulary()
    group = parser.add_argument_group(
        "slime flags accepted or refused",
        f"slime's other flags (at slime {vocab.slime_commit}) parse: those whose value is what this project does "
        "anyway are accepted with that value, the rest are refused saying what to use instead. The list: "
        "slime_search/compat/slime_flags.toml; docs/from_slime.md (Flags).",
    )
    group.add_argument(
        "--custom-config-path",
        default=None,
        help="YAML file of KEY: VALUE set on the flags after parsing, overriding the command line (slime's): a key is "
        "a flag's attribute (tis_cap, eval_interval, ...), a slime flag's, or one slime's TIS/MIS helper reads "
        "(use_rs, tis_level, tis_upper_bound, ...; examples/train_infer_mismatch_helper/mis.yaml); each checked as "
        "its flag is",
    )
    for flag in vocab.answered("accepted") + vocab.answered("refused"):
        group.add_argument(flag.name, **flag.declaration())


def apply_slime_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Merge --custom-config-path onto `args`, then refuse any slime flag given (or set by the file) that the data
    file refuses or whose value is not the one accepted. ValueError naming the flag, and the key and file if set
    there."""
    merged = merge_custom_config(parser, args) if args.custom_config_path else {}
    given = vars(args)
    for flag in vocabulary().answered("accepted") + vocabulary().answered("refused"):
        if flag.dest in given and (problem := flag.problem(given[flag.dest], args)):
            raise ValueError(f"{merged[flag.dest]}: {problem}" if flag.dest in merged else problem)
        if flag.same_as_env and flag.dest in given:
            delattr(args, flag.dest)  # a secret the environment holds already: kept out of the flags (wandb's config)


def merge_custom_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Set each key of the YAML file on `args`, its value converted as its flag's would be; the keys set, as
    {attribute: "KEY in FILE"}."""
    import yaml

    path = args.custom_config_path
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as err:
        raise ValueError(f"--custom-config-path {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--custom-config-path {path}: not YAML ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--custom-config-path {path}: needs a mapping of keys to values, got {type(data).__name__}")
    merged = {}
    for key, value in data.items():
        try:
            dest, converted = config_value(parser, str(key), value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as err:
            raise ValueError(f"{key} in {path}: {err}") from None
        setattr(args, dest, converted)
        merged[dest] = f"{key} in {path}"
    return merged


def config_value(parser: argparse.ArgumentParser, key: str, value: Any) -> tuple[str, Any]:
    """The attribute a --custom-config-path key sets and its value: the key is one of our flags' attributes, a slime
    flag's (set as that flag is), or a key slime's TIS/MIS helper reads."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    slime_flag = vocabulary().by_dest(key)
    if slime_flag is not None and slime_flag.answer == "refused":
        return key, value  # refused whatever its value, by apply_slime_flags
    if slime_flag is not None and slime_flag.name in actions:  # set as the flag sets it: tis_clip sets tis_cap
        action = actions[slime_flag.name]
        return action.dest, converted(action, value)
    ours = [action for action in parser._actions if action.dest == key and action.option_strings]
    if ours:  # several flags may share an attribute (--advantage-estimator, --disable-grpo-std-normalization)
        return key, converted(max(ours, key=lambda action: action.nargs != 0), value)
    if key in vocabulary().tis_keys:
        return key, tis_value(vocabulary().tis_keys[key], value)
    raise ValueError(
        "no flag of this project's or of slime's has this attribute, and slime's TIS/MIS helper does not read it "
        f"(its keys: {', '.join(vocabulary().tis_keys)})"
    )


def converted(action: argparse.Action, value: Any) -> Any:
    """A YAML value as `action` would have parsed it from the command line: through its type, within its choices."""
    flag = action.option_strings[0]
    if value is None:
        if action.default not in (None, argparse.SUPPRESS):
            raise ValueError(f"null, but {flag} needs a value")
        return None
    if action.type is json_value:  # YAML has parsed it already
        return value
    if action.nargs == "?" and isinstance(value, bool):  # a switch that may take a value (--save-hf): true is bare
        return action.const if value else action.default
    if action.nargs == 0:
        if isinstance(action, argparse.BooleanOptionalAction) or isinstance(action.const, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{flag} is a switch: write true or false, not {value!r}")
            return value
        raise ValueError(f"{flag} sets {action.dest} to {action.const!r}: write `{action.dest}: {action.const}`")
    many = action.nargs not in (None, "?")
    if many != isinstance(value, list) or isinstance(value, dict):
        raise ValueError(f"{flag} takes {'a list of values' if many else 'one value'}, not {value!r}")
    items = [one_value(action, item) for item in (value if many else [value])]
    return items if many else items[0]


def one_value(action: argparse.Action, item: Any) -> Any:
    if isinstance(item, (list, dict)):
        raise ValueError(f"{action.option_strings[0]} takes a plain value, not {item!r}")
    value = action.type(str(item)) if action.type is not None else str(item)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{action.option_strings[0]}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def tis_value(spec: dict[str, Any], value: Any) -> Any:
    """A value for slime's TIS/MIS helper, of the type it reads (YAML reads 1e-4, without a dot, as a string)."""
    if value is None:
        if not spec.get("nullable"):
            raise ValueError("null, but slime's TIS/MIS helper needs a value here")
        return None
    if "choices" in spec:
        if value not in spec["choices"]:
            raise ValueError(f"{value!r} is not one of {', '.join(spec['choices'])}")
        return value
    if spec["type"] == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"write true or false, not {value!r}")
        return value
    if isinstance(value, bool):
        raise ValueError(f"a number is needed, not {value!r}")
    return float(value)


def unknown_flags_message(extras: list[str]) -> str:
    """The usage error for what neither this project nor slime knows, naming each unknown flag.

    It tells SGLang's server flags apart (slime passes them through as --sglang-*), since their settings here have
    flags of their own."""
    flags = [item.split("=", 1)[0] for item in extras if item.startswith("--")]
    if not flags:
        return f"unexpected arguments {' '.join(extras)}: every value belongs to a flag"
    sglang = [flag for flag in flags if flag.startswith("--sglang-")]
    other = [flag for flag in flags if not flag.startswith("--sglang-")]
    parts = []
    if sglang:
        parts.append(
            f"{', '.join(sglang)}: SGLang's server flags are not passed through; the engines are started with "
            "--sglang-mem-fraction-static and --rollout-num-gpus-per-engine, or start SGLang yourself with any "
            "flags and give its address with --engine-url"
        )
    if other:
        parts.append(
            f"{', '.join(other)}: not a flag of this project, nor of slime at {vocabulary().slime_commit} "
            "(docs/from_slime.md lists how slime's flags are answered)"
        )
    return "; ".join(parts)
