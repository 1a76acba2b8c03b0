"""A command-line flag declared once, as a field of the typed config it sets.

`flag(default, help, ...)` is a dataclass field whose metadata carries the flag's help, its converter, its choices, its
aliases and whether it is slime's flag with slime's meaning. `add_flags` declares a config class's flags on a parser;
the field's default is the flag's default, so they cannot drift. `from_flags` builds the config from the parsed flags,
in one direction. `slime_flag_names` lists the slime names the fields carry, for the slime vocabulary. Validation is the
converter's (at parse time) and the config's `__post_init__` (at construction).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

FLAG = "flag"  # the metadata key of a field that is a command-line flag


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # `flag(REQUIRED, ...)`: the field has no default and the flag must be given


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    help: str
    name: str | None = None  # the flag's name where it is not the field's (--health-grad-spike for grad_spike)
    type: Callable[[str], Any] | None = None
    choices: tuple | None = None
    aliases: tuple[str, ...] = ()  # other spellings, slime's among them where it has another name
    negatable: bool = False  # a bool flag: --no-x as well (always where its default is True)
    # True, or the name slime declares this flag under, with this meaning (honoured)
    slime_name: bool | str | None = None
    nargs: str | None = None  # argparse's: "+" for a list, "?" for an optional value (with `const`)
    const: Any = None
    metavar: str | None = None
    # more flags that each set the field to a constant: (flag, value, help, slime's too); slime's
    # --disable-grpo-std-normalization sets --advantage-estimator dr_grpo
    switches: tuple[tuple[str, Any, str, bool], ...] = ()
    exclusive: str | None = None  # fields of one class with the same name here: at most one of their flags is given


def flag(
    default: Any,
    help: str,
    *,
    name: str | None = None,
    type: Callable[[str], Any] | None = None,
    choices: Iterable | None = None,
    aliases: tuple[str, ...] = (),
    negatable: bool = False,
    slime: bool | str = False,
    nargs: str | None = None,
    const: Any = None,
    metavar: str | None = None,
    switches: tuple[tuple[str, Any, str, bool], ...] = (),
    exclusive: str | None = None,
) -> Any:
    """A field that is also a flag, `--field-name-with-dashes` or `name`; a bool field is a switch (--x where its
    default is False, --x / --no-x where it is True or `negatable`). `slime`: True where slime declares the same name
    with this meaning, or slime's name where it is one of `aliases`."""
    if isinstance(slime, str) and slime not in aliases:
        raise ValueError(f"slime's name {slime} is not among the aliases {aliases}")
    choices = tuple(choices) if choices is not None else None
    spec = FlagSpec(
        help,
        name,
        type,
        choices,
        aliases,
        negatable,
        slime if slime else None,
        nargs,
        const,
        metavar,
        switches,
        exclusive,
    )
    if default is REQUIRED:
        return dataclasses.field(metadata={FLAG: spec})
    if isinstance(default, (list, dict, set)):
        raise TypeError(f"a flag's default must be immutable (a tuple, not {default!r}): the field is frozen")
    return dataclasses.field(default=default, metadata={FLAG: spec})


def is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata[FLAG].name or "--" + field.name.replace("_", "-")


def flag_dest(field: dataclasses.Field) -> str:
    """The parsed flags' attribute for the field's flag (argparse's, from the flag's name)."""
    return flag_name(field).removeprefix("--").replace("-", "_")


def flag_fields(config_class: type) -> list[dataclasses.Field]:
    """The fields of `config_class` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(config_class) if FLAG in f.metadata]


def add_flags(
    group: argparse._ActionsContainer,
    config_class: type,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    required: Iterable[str] = (),
) -> None:
    """Declare the flag fields of `config_class` on `group` (a parser or an argument group). It declares every one, or
    those named in `only`, less those in `skip`. That serves a CLI that takes some of a class's flags, or a class whose
    flags sit in two groups of the help. The flags of the fields in `required` must be given on this CLI (the converters
    need the model's shape, which training reads from config.json)."""
    fields = flag_fields(config_class)
    names = {field.name for field in fields}
    required = set(required)
    unknown = (set(only or ()) | set(skip) | required) - names
    if unknown:
        raise TypeError(f"{config_class.__name__} has no flag fields {sorted(unknown)}")
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for field in fields:
        if (only is not None and field.name not in only) or field.name in skip:
            continue
        spec: FlagSpec = field.metadata[FLAG]
        target = group
        if spec.exclusive is not None:
            if spec.exclusive not in exclusive:
                exclusive[spec.exclusive] = group.add_mutually_exclusive_group()
            target = exclusive[spec.exclusive]
        keywords = argument_keywords(field, spec)
        if field.name in required:
            keywords.pop("default", None)
            keywords["required"] = True
        target.add_argument(flag_name(field), *spec.aliases, **keywords)
        for switch, value, switch_help, _ in spec.switches:
            target.add_argument(switch, dest=flag_dest(field), action="store_const", const=value, help=switch_help)


def argument_keywords(field: dataclasses.Field, spec: FlagSpec) -> dict[str, Any]:
    """add_argument's keywords for a flag field: its default (or required), and how its value is read."""
    keywords: dict[str, Any] = {"dest": flag_dest(field), "help": spec.help}
    if is_required(field):
        keywords["required"] = True
    else:
        keywords["default"] = field.default
    if isinstance(field.default, bool) and spec.nargs is None:
        negatable = field.default or spec.negatable
        keywords["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
        return keywords
    for name in ("type", "choices", "nargs", "const", "metavar"):
        if getattr(spec, name) is not None:
            keywords[name] = getattr(spec, name)
    return keywords


def from_flags(config_class: type, args: argparse.Namespace, **derived: Any):
    """`config_class` from the parsed flags; `derived` sets the fields computed from other flags (a default that
    depends on the run's length, say), and fields that are not flags keep their defaults."""
    values = {field.name: getattr(args, flag_dest(field)) for field in flag_fields(config_class)}
    # a list flag (nargs="+") is kept as a tuple: the configs are frozen
    values = {name: tuple(value) if isinstance(value, list) else value for name, value in values.items()}
    unknown = set(derived) - {field.name for field in dataclasses.fields(config_class)}
    if unknown:
        raise TypeError(f"{config_class.__name__} has no fields {sorted(unknown)}")
    return config_class(**{**values, **derived})


def slime_flag_names(config_classes: Iterable[type]) -> list[str]:
    """slime's name of every field slime declares too, in declaration order."""
    names = []
    for config_class in config_classes:
        for field in flag_fields(config_class):
            slime_name = field.metadata[FLAG].slime_name
            if slime_name is not None:
                names.append(flag_name(field) if slime_name is True else slime_name)
            names += [switch for switch, _, _, slime in field.metadata[FLAG].switches if slime]
    return names
