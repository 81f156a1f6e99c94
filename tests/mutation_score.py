"""`make mutate`'s report: the mutation score of each mutated module, from mutmut's result files.

Score = killed / (killed + survived), counting timeouts and crashes as killed (the test run noticed) and
leaving out mutants not checked in this run. A survivor listed in mutmut-equivalents.md counts as
equivalent, not as survived; survivors not listed there are printed, so that each gets a test or a line.
Each module's list there names the git blob of the source it was judged on: mutant numbers shift when the
source changes, so a list judged on another version counts for nothing (its survivors show as unlisted) until
it is re-judged. Run from the repository root after `mutmut run`: `python tests/mutation_score.py`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS = ROOT / "mutmut-equivalents.md"
KILLED = {1, 3, 24, -24, 152, 255, 36, -11, -9}  # test failure, pytest error, timeout, crash
# mutmut's limits: a CPU-time limit from the tests' measured durations (SIGXCPU, -24 / 152 / 24 / 36). On a busy
# machine a mutant whose tests all pass can hit it too, so these are listed apart: rerun them on a quiet one.
TIMEOUTS = {24, -24, 152, 36}
SURVIVED = 0


@dataclass(slots=True)
class Score:
    killed: int = 0
    timeouts: list[str] = field(default_factory=list)
    survived: list[str] = field(default_factory=list)
    equivalent: int = 0
    unchecked: int = 0
    no_tests: list[str] = field(default_factory=list)

    def line(self, module: str) -> str:
        judged = self.killed + len(self.survived) + self.equivalent
        score = 100.0 * (self.killed + self.equivalent) / judged if judged else float("nan")
        return (
            f"{module:28} {score:6.1f}%  killed {self.killed:4} (timeouts {len(self.timeouts):3})  "
            f"equivalent {self.equivalent:3}  "
            f"survived {len(self.survived):3}  no tests {len(self.no_tests):3}  not checked {self.unchecked:4}"
        )


def git_blob(path: Path) -> str:
    """What `git hash-object path` prints, without needing git."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def equivalents() -> tuple[set[str], list[str]]:
    """Mutant names listed (in backticks, first on their line) in mutmut-equivalents.md under a `## module`
    heading whose `blob` line matches the module's current source; and a warning per stale module list."""
    if not EQUIVALENTS.is_file():
        return set(), []
    listed: set[str] = set()
    stale: list[str] = []
    for section in re.split(r"^## ", EQUIVALENTS.read_text(), flags=re.MULTILINE)[1:]:
        module = section.split(None, 1)[0]
        names = re.findall(r"^- `([^`]+)`", section, flags=re.MULTILINE)
        judged = re.search(r"^Judged on blob `([0-9a-f]{40})`", section, flags=re.MULTILINE)
        source = ROOT / module
        if judged and source.is_file() and judged.group(1) == git_blob(source):
            listed.update(names)
        else:
            stale.append(f"{module}: its {len(names)} entries were judged on another version; re-judge them")
    return listed, stale


def scores(mutants_dir: Path) -> dict[str, Score]:
    listed, _ = equivalents()
    out: dict[str, Score] = {}
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        module = str(meta.relative_to(mutants_dir))[: -len(".meta")]
        score = out.setdefault(module, Score())
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if code is None:
                score.unchecked += 1
            elif code == SURVIVED:
                if name in listed:
                    score.equivalent += 1
                else:
                    score.survived.append(name)
            elif code in (5, 33):
                score.no_tests.append(name)
            elif code in KILLED:
                score.killed += 1
                if code in TIMEOUTS:
                    score.timeouts.append(name)
            else:
                score.survived.append(name)  # "suspicious" and the rest: not a kill
    return out


def main() -> int:
    result = scores(ROOT / "mutants")
    if not result:
        print("no mutmut results under mutants/: run `make mutate` first")
        return 1
    for module, score in result.items():
        if score.killed or score.survived or score.equivalent or score.no_tests:
            print(score.line(module))
    for warning in equivalents()[1]:
        print(f"stale: {warning}")
    timeouts = [name for s in result.values() for name in s.timeouts]
    if timeouts:
        print(f"\n{len(timeouts)} counted as killed by mutmut's time limit (check them on a quiet machine):")
        print("\n".join(f"  {name}" for name in timeouts))
    unlisted = [name for s in result.values() for name in s.survived + s.no_tests]
    if unlisted:
        print(f"\n{len(unlisted)} survivors neither killed nor listed in {EQUIVALENTS.name}:")
        print("\n".join(f"  {name}" for name in unlisted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
