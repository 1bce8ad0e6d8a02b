"""Parsing optimized HLO text (`compiled.as_text()`): computations, instructions, shapes,
attributes and loop trip counts, for counting FLOPs (`jaxlight.analysis._flops`)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

#: A shape such as `f32[8,64]{1,0}`: its element type and dimensions.
SHAPE_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
#: An instruction or computation name (`%fusion.3`).
NAME_RE = re.compile(r"%?([\w.\-]+)")


@dataclasses.dataclass
class Instr:
    """One HLO instruction: `name = shape opcode(operands), attrs`."""

    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


def split_top(text: str, sep: str = ",") -> list[str]:
    """Splits on `sep` outside brackets and quotes."""
    out, depth, cur, quote = [], 0, [], False
    for ch in text:
        if ch == '"':
            quote = not quote
        elif not quote and ch in "([{":
            depth += 1
        elif not quote and ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0 and not quote:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return [p.strip() for p in out if p.strip()]


def balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at `text[start]`."""
    depth, quote = 0, False
    for i in range(start, len(text)):
        ch = text[i]
        if ch == '"':
            quote = not quote
        elif quote:
            continue
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def parse_instruction(line: str) -> Instr | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    eq = line.find(" = ")
    if eq < 0:
        return None
    name = line[:eq].strip().lstrip("%")
    rest = line[eq + 3:].lstrip()
    if rest.startswith("("):  # tuple shape
        end = balanced(rest, 0)
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren].strip()
    close = balanced(rest, paren)
    operands = []
    for part in split_top(rest[paren + 1:close - 1]):
        # Operands print as "%name" or, in older dumps, "f32[2,3]{1,0} %name".
        tokens = part.split()
        if tokens:
            operands.append(tokens[-1].lstrip("%"))
    return Instr(name, shape, opcode, operands, rest[close:])


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str | None]:
    """Computations by name (instructions in order) and the entry computation's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if not stripped or stripped.startswith("//") or stripped.startswith("HloModule"):
            continue
        if current is None:
            if stripped.endswith("{"):
                header = stripped[6:] if stripped.startswith("ENTRY ") else stripped
                match = NAME_RE.match(header)
                if match:
                    current = match.group(1)
                    comps[current] = []
                    if stripped.startswith("ENTRY "):
                        entry = current
            continue
        if stripped == "}":
            current = None
            continue
        instr = parse_instruction(stripped)
        if instr is not None:
            comps[current].append(instr)
    return comps, entry


def dims(shape: str) -> list[list[int]]:
    """The dimensions of each array in a (possibly tuple) shape string."""
    out = []
    for _, dims in SHAPE_RE.findall(shape):
        out.append([int(d.replace("<=", "")) for d in dims.split(",") if d.strip()])
    return out


def elements(shape: str) -> int:
    arrays = dims(shape)
    return math.prod(arrays[0]) if arrays else 0


def attr_ints(attrs: str, key: str) -> list[int]:
    match = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
    return [int(v) for v in match.group(1).split(",") if v.strip()] if match else []


def called_computations(attrs: str, key: str) -> list[str]:
    match = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
    if match:
        return [n.strip().lstrip("%") for n in match.group(1).split(",") if n.strip()]
    match = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return [match.group(1)] if match else []


def backend_config(attrs: str) -> dict:
    key = "backend_config="
    at = attrs.find(key)
    if at < 0:
        return {}
    start = at + len(key)
    if start < len(attrs) and attrs[start] == "{":
        try:
            return json.loads(attrs[start:balanced(attrs, start)])
        except ValueError:
            return {}
    return {}


def trip_count(instr: Instr) -> int | None:
    config = backend_config(instr.attrs)
    n = config.get("known_trip_count", {}).get("n")
    if n is not None:
        return int(n)
    match = re.search(r'known_trip_count[^0-9]*"?n"?\s*:\s*"?(\d+)', instr.attrs)
    return int(match.group(1)) if match else None
