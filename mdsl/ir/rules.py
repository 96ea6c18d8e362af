"""Rule tables: what one consumer of the operator registry knows of each operator.

The registry (`mdsl.ir.ops`) says what an operator is: its levels, attributes, shape rule and reference
semantics. Everything a later layer does with it (its abstract expression, its finite-field meaning, each
backend's code) is a rule of that layer, kept in that layer's own `RuleTable`: operator name -> a rule of
the table's type. A table lives in its consumer's module and is filled there, so importing the consumer is
all it takes for its rules to exist, and no layer writes into another's entries. Adding an operator is its
`OpDef`, its frontend function and one `register` line per table.

A table knows which operators must have a rule (`needs`, from their category and levels) and what a rule
must provide for an operator (`provides`: e.g. a backend's `kernel` method for an operator that appears at
the kernel level), so that `missing()` lists the gaps: `tests/ir/test_rule_tables.py` asserts there are
none. A table whose keys are the consumer's choice (the ops a fast path accepts) needs nothing; one may give
a rule to a whole category (`by_category`) instead of naming each operator.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, Mapping, Optional, TypeVar

from mdsl.errors import SourceLoc, UnsupportedError
from mdsl.ir.ops import OPS

R = TypeVar("R")

#: every table made, in order: the completeness test checks that it knows each of them
TABLES: list = []


def _never(op) -> bool:
    return False


def _nothing(op) -> tuple:
    return ()


class RuleTable(Generic[R]):
    """Operator name -> the rule of one consumer (`consumer`, a few words: "the CUDA backend").

    `rule_type`: the type every rule is an instance of; `where`: the module that registers the rules (for
    the hint of a missing one); `registry`: the operators the names come from (`mdsl.ir.ops.OPS`, or the
    megakernel's layer ops); `needs(op)`: whether `op` must have a rule; `provides(op)`: the attributes a
    rule of `op` must have; `by_category(op)`: the rule of an operator that has none of its own (None: no
    rule), so that a rule may cover a category, operators added later included."""

    def __init__(self, consumer: str, rule_type: type, where: str, *, registry: Optional[Mapping] = None,
                 needs: Callable = _never, provides: Callable = _nothing,
                 by_category: Optional[Callable] = None):
        self.consumer, self.rule_type, self.where = consumer, rule_type, where
        self.registry = OPS if registry is None else registry
        self.needs, self.provides, self.by_category = needs, provides, by_category
        self._rules: dict = {}
        TABLES.append(self)

    def __repr__(self) -> str:
        return f"RuleTable({self.consumer!r}, {len(self._rules)} rules)"

    # --- filling

    def register(self, name: str, rule: R) -> R:
        """Give operator `name` its rule (once); returns the rule."""
        if name in self._rules:
            raise ValueError(f"{name} has a rule in the {self.consumer} already")
        self._set(name, rule)
        return rule

    def unregister(self, name: str) -> None:
        """Drop operator `name`'s rule (an operator made for a test, removed after it)."""
        self._rules.pop(name, None)

    def _set(self, name: str, rule: R) -> None:
        if name not in self.registry:
            raise ValueError(f"the {self.consumer} gives a rule to {name!r}, which is not a registered operator")
        if not isinstance(rule, self.rule_type):
            raise TypeError(f"the {self.consumer}'s rule of {name} is a {type(rule).__name__}, "
                            f"not a {self.rule_type.__name__}")
        self._rules[name] = rule

    # mapping-style access, so that a test may swap a rule for the duration of one test (monkeypatch)
    def __setitem__(self, name: str, rule: R) -> None:
        self._set(name, rule)

    def __delitem__(self, name: str) -> None:
        del self._rules[name]

    # --- reading

    def get(self, name: str, default: Optional[R] = None) -> Optional[R]:
        """The rule of operator `name`: its own, else its category's, else `default`."""
        rule = self._rules.get(name)
        if rule is None and self.by_category is not None and name in self.registry:
            rule = self.by_category(self.registry[name])
        return default if rule is None else rule

    def lookup(self, name: str, loc: Optional[SourceLoc] = None) -> R:
        """The rule of operator `name`, or an error naming the operator and this consumer."""
        rule = self.get(name)
        if rule is None:
            raise UnsupportedError(f"the {self.consumer} has no rule for {name}", loc=loc,
                                   hint=f"register one in {self.where} ({self.rule_type.__name__})")
        return rule

    def __getitem__(self, name: str) -> R:
        return self.lookup(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __iter__(self) -> Iterator[str]:
        """The names of the operators with a rule (their own or their category's), in registry order."""
        return (name for name in list(self.registry) if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def keys(self) -> list:
        return list(self)

    def items(self) -> list:
        return [(name, self.get(name)) for name in self]

    # --- completeness

    def missing(self, names=None) -> dict:
        """Operator name -> what it lacks here ("no rule", or the attributes its rule lacks), for the
        operators `names` (default: those the table needs)."""
        if names is None:
            names = [name for name, op in self.registry.items() if self.needs(op)]
        out = {}
        for name in names:
            rule = self.get(name)
            if rule is None:
                out[name] = "no rule"
                continue
            lacking = [a for a in self.provides(self.registry[name]) if not hasattr(rule, a)]
            if lacking:
                out[name] = "no " + ", ".join(lacking)
        return out
