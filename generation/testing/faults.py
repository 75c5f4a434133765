"""Faults the fake Gemini server injects: which kinds exist, which calls they hit (deterministically)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("writer", "editor", "judge")
# kind -> the roles it hits unless a role is given
FAULT_KINDS = {
    "429": ROLES, "500": ROLES, "503": ROLES, "hang": ROLES, "invalid_argument": ROLES, "safety": ROLES,
    "malformed_json": ("judge",), "truncated_json": ("judge",),
    "torn_body": ROLES,  # a 200 whose HTTP body stops halfway (a proxy or connection cut it)
    "new_fields": ROLES,  # a 200 with fields a newer API version added, at several depths: clients must read on
    "text_only": ("editor",), "no_image": ("editor",), "image_safety": ("editor",),
    "truncated_image": ("editor",), "png_image": ("editor",),
    "batch_failed": ROLES,  # a whole batch job ends FAILED (struck once per job, by the role of its requests)
}


@dataclass
class Fault:
    """One injected fault. Without `first` or `rate` it hits every matching call."""

    kind: str
    first: int | None = None  # hit the first N matching calls
    rate: float | None = None  # or this fraction of them, spread evenly (deterministic)
    role: str | None = None  # writer | editor | judge; default: the roles the kind applies to
    retry_after: float = 1.0  # seconds, for 429
    hang: float = 30.0  # seconds a hanging call holds the connection
    seen: int = field(default=0, repr=False)

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; known: {', '.join(FAULT_KINDS)}")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"fault role must be one of {ROLES}, not {self.role!r}")

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        """'KIND[:key=value,...]', e.g. '429:first=2,retry_after=1' or 'text_only:rate=0.2'."""
        kind, _, rest = spec.partition(":")
        options: dict = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key not in ("first", "rate", "role", "retry_after", "hang"):
                raise ValueError(f"unknown fault option {key!r} in {spec!r}")
            options[key] = value if key == "role" else (int(value) if key == "first" else float(value))
        return cls(kind, **options)

    def applies(self, role: str) -> bool:
        return role == self.role if self.role else role in FAULT_KINDS[self.kind]

    def strike(self) -> bool:
        """Count one matching call; whether the fault hits it."""
        i, self.seen = self.seen, self.seen + 1
        if self.first is not None:
            return i < self.first
        if self.rate is not None:  # hits exactly floor(n * rate) of the first n calls
            return int((i + 1) * self.rate) > int(i * self.rate)
        return True


def parse_faults(specs) -> list[Fault]:
    """Faults from `Fault` objects or 'KIND[:key=value,...]' strings."""
    return [Fault.parse(f) if isinstance(f, str) else f for f in specs]
