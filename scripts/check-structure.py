#!/usr/bin/env python3
"""Structural checks on the sources (STYLE.md: functions fit on a screen; one door into
communication).

  check-structure.py functions [--max-lines N] [PATH...]
      Every function defined in PATH (files or folders; default: src/, cli/, zoo/ and benchmarks/)
      spans at most N lines (80), from its first line to its closing brace. Function extents come
      from universal-ctags (`--output-format=json`, the `end` field).

  check-structure.py c10d [PATH...]
      No c10d outside src/dist/ and include/scaletrain/dist.h: no `c10d::` name and no call on a
      Dist's backend or store (`.backend->`, `.store->`) in PATH (default: src/, cli/, zoo/,
      include/ and benchmarks/; the tests may reach behind Dist to test it). Comments and string literals do not count. Callers use Dist's methods.

  check-structure.py rooms [SRC]
      No two rooms (the folders of SRC, default src/) include each other, directly or around a
      longer circle: an internal include "room/x.h" belongs to its folder, a public
      "scaletrain/x.h" to the folder of the x.cpp that implements it.

  check-structure.py zoo [PATH...]
      The library does not depend on the zoo: no file in PATH (default: src/ and include/)
      includes a zoo header (zoo_models.h, scaletrain_zoo.h, gpt.h, kernels/) or calls
      make_model(), ModelOptions or zoo_task. Comments and string literals do not count.

Prints one line per offence (path:line: what, and the fix) and exits 1 if there is any, 0 if
none, 2 when it cannot check (no universal-ctags: install it, scripts/setup.sh does).
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".cpp", ".cc", ".h", ".hpp"}
# Where c10d may be named: the implementation of Dist and its header.
C10D_HOME = ("src/dist/", "include/scaletrain/dist.h")
C10D_USE = re.compile(r"\bc10d::|(?:\.|->)\s*(?:backend|store)\s*->")


def source_files(paths):
    for p in paths:
        p = Path(p)
        if p.is_dir():
            yield from sorted(f for f in p.rglob("*") if f.suffix in SOURCE_SUFFIXES)
        elif p.exists():
            yield p
        else:
            raise SystemExit(f"check-structure: no such file or folder: {p}")


def shown(path):
    path = Path(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def find_ctags():
    for name in ("ctags-universal", "universal-ctags", "ctags"):
        exe = shutil.which(name)
        if not exe:
            continue
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        if "Universal Ctags" in out:
            return exe
    print("check-structure: universal-ctags is not installed (apt-get install universal-ctags, "
          "or scripts/setup.sh)", file=sys.stderr)
    sys.exit(2)


def function_extents(files):
    """(path, first line, last line, qualified name) of every function defined in `files`."""
    if not files:
        return []
    cmd = [find_ctags(), "--output-format=json", "--fields=+neS", "--kinds-C++=f",
           "--language-force=C++", "-f", "-"] + [str(f) for f in files]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(f"check-structure: ctags failed: {run.stderr.strip()}", file=sys.stderr)
        sys.exit(2)
    out = []
    for line in run.stdout.splitlines():
        tag = json.loads(line)
        if tag.get("_type") != "tag" or "end" not in tag:
            continue
        scope = tag.get("scope", "")
        name = (scope + "::" if scope else "") + tag["name"]
        out.append((tag["path"], int(tag["line"]), int(tag["end"]), name))
    return out


def check_functions(paths, max_lines):
    files = list(source_files(paths))
    bad = 0
    for path, first, last, name in sorted(function_extents(files)):
        lines = last - first + 1
        if lines > max_lines:
            print(f"{shown(path)}:{first}: {name} is {lines} lines, more than {max_lines}: split "
                  "it into helpers named for what they do")
            bad += 1
    print(f"check-structure: {len(files)} files, {bad} function(s) over {max_lines} lines",
          file=sys.stderr)
    return bad


def code_only(line, in_comment):
    """`line` without comments and string literals; whether a /* comment runs on past it."""
    out, i = [], 0
    while i < len(line):
        if in_comment:
            end = line.find("*/", i)
            if end < 0:
                return "".join(out), True
            i, in_comment = end + 2, False
        elif line.startswith("//", i):
            break
        elif line.startswith("/*", i):
            in_comment, i = True, i + 2
        elif line[i] in "\"'":
            quote, i = line[i], i + 1
            while i < len(line) and line[i] != quote:
                i += 2 if line[i] == "\\" else 1
            i += 1
            out.append(quote + quote)
        else:
            out.append(line[i])
            i += 1
    return "".join(out), in_comment


def check_c10d(paths):
    bad = 0
    files = list(source_files(paths))
    for f in files:
        if any(home in shown(f) for home in C10D_HOME):
            continue
        in_comment = False
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            code, in_comment = code_only(line, in_comment)
            if code.lstrip().startswith("#include"):
                continue  # headers (the precompiled one) may name c10d's files
            if C10D_USE.search(code):
                print(f"{shown(f)}:{n}: c10d outside src/dist: {line.strip()}\n"
                      "    use Dist's methods (include/scaletrain/dist.h): collectives, "
                      "isend/irecv, the _async forms returning a Pending, store_*")
                bad += 1
    print(f"check-structure: {len(files)} files, {bad} use(s) of c10d outside src/dist",
          file=sys.stderr)
    return bad


ZOO_INCLUDE = re.compile(r'#\s*include\s*"(?:zoo_models\.h|scaletrain_zoo\.h|gpt\.h|kernels/)')
ZOO_USE = re.compile(r"\b(?:make_model|ModelOptions|zoo_task|TrainOptions)\b")


def check_zoo(paths):
    bad = 0
    files = list(source_files(paths))
    for f in files:
        in_comment = False
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if ZOO_INCLUDE.search(line):
                what = "includes a zoo header"
            else:
                code, in_comment = code_only(line, in_comment)
                if not ZOO_USE.search(code):
                    continue
                what = "names the zoo"
            print(f"{shown(f)}:{n}: the library {what}: {line.strip()}\n"
                  "    the zoo (zoo/) builds on the library, never the other way round: take a "
                  "scaletrain::Model or a TrainTask from the caller")
            bad += 1
    print(f"check-structure: {len(files)} files, {bad} use(s) of the zoo in the library",
          file=sys.stderr)
    return bad


INCLUDE = re.compile(r'#\s*include\s*"([a-z_]+)/([a-z_0-9]+)\.h"')


def room_includes(src):
    """Each room of the library (a folder under `src`) and the rooms its files include, with
    the first include line that does it. A public header (include/scaletrain/x.h) is the room of
    the x.cpp that implements it (of the including room where it has one too); one with no
    x.cpp, or several elsewhere, belongs to no room; its own includes are that room's."""
    rooms = sorted(p for p in src.iterdir() if p.is_dir())
    homes = {}
    for room in rooms:
        for f in sorted(room.glob("*.cpp")):
            homes.setdefault(f.stem, set()).add(room.name)

    def home(name, room):  # several rooms with an x.cpp: the including one, else none
        where = homes.get(name, set())
        return room if room in where else (next(iter(where)) if len(where) == 1 else None)

    uses = {}
    public = src.parent / "include" / "scaletrain"
    for room in rooms:
        # A public header's own includes count for the room that implements it.
        mine = [h for h in sorted(public.glob("*.h")) if public.is_dir() and home(h.stem, room.name) == room.name]
        for f in sorted(room.iterdir()) + mine:
            if f.suffix not in SOURCE_SUFFIXES:
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                m = INCLUDE.match(line.strip())
                if not m:
                    continue
                folder, name = m.groups()
                target = home(name, room.name) if folder == "scaletrain" else folder
                if target and target != room.name and (src / target).is_dir():
                    uses.setdefault(room.name, {}).setdefault(target, f"{shown(f)}:{n}")
    return uses


def check_rooms(src):
    uses = room_includes(src)
    bad = 0
    # A circle through two or more rooms: a room that reaches itself again.
    def reaches(start, goal, seen):
        for nxt in uses.get(start, {}):
            if nxt == goal:
                return [start, nxt]
            if nxt not in seen:
                seen.add(nxt)
                path = reaches(nxt, goal, seen)
                if path:
                    return [start] + path
        return None
    reported = set()
    for room in sorted(uses):
        path = reaches(room, room, set())
        if not path or frozenset(path) in reported:
            continue
        reported.add(frozenset(path))
        steps = [f"{a} -> {b} ({uses[a][b]})" for a, b in zip(path, path[1:])]
        print("rooms that include each other in a circle: " + "; ".join(steps) + "\n"
              "    move what both need into a room below both (runtime/, plan/), or the code "
              "into the room whose header declares it")
        bad += 1
    print(f"check-structure: {len(uses)} rooms, {bad} circle(s)", file=sys.stderr)
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="check", required=True)
    fn = sub.add_parser("functions", help="functions over --max-lines lines")
    fn.add_argument("--max-lines", type=int, default=80)
    fn.add_argument("paths", nargs="*")
    cd = sub.add_parser("c10d", help="c10d used outside src/dist")
    cd.add_argument("paths", nargs="*")
    zo = sub.add_parser("zoo", help="the library depending on the zoo")
    zo.add_argument("paths", nargs="*")
    ro = sub.add_parser("rooms", help="rooms of src/ that include each other in a circle")
    ro.add_argument("src", nargs="?")
    args = ap.parse_args()
    if args.check == "functions":
        bad = check_functions(
            args.paths or [ROOT / d for d in ("src", "cli", "zoo", "benchmarks")], args.max_lines)
    elif args.check == "rooms":
        bad = check_rooms(Path(args.src) if args.src else ROOT / "src")
    elif args.check == "zoo":
        bad = check_zoo(args.paths or [ROOT / "src", ROOT / "include"])
    else:
        bad = check_c10d(
            args.paths or [ROOT / d for d in ("src", "cli", "zoo", "include", "benchmarks")])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
