"""The lab's git repository: the one place that knows its scheme.

The baseline is the branch `autoresearch/baseline` (`BASELINE_BRANCH`); each promotion tags its
commit `baseline/vN` (`BASELINE_TAG_PREFIX`), and a commit's generation is how many such tags its
history holds (the seed block its runs use, `pipeline.experiment`). A revision resolves to a full
sha here, and only here; tags are created here, and merges are computed here without a working
tree (`git merge-tree`), so nothing in the lab's checkout moves. `agent.workspace.Workspace` (the
hypotheses' branches and edits) is a `LabRepo`; `pipeline.worktrees.Worktrees` resolves through one.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import git

from pipeline.errors import PromotionConflict, UserError
from pipeline.lab import BASELINE_BRANCH

BASELINE_TAG_PREFIX = "baseline/v"
BASELINE_TAGS = BASELINE_TAG_PREFIX + "*"  # a `git tag --list` pattern
_TAG = re.compile(re.escape(BASELINE_TAG_PREFIX) + r"(\d+)")


def baseline_number(tag: str | None) -> int | None:
    """N of a tag `baseline/vN`; None for any other name."""
    m = _TAG.fullmatch(tag or "")
    return int(m.group(1)) if m else None


class LabRepo:
    """The lab's repository at `root`: resolving, the baseline and its tags, generations, tags, merges."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        try:
            self.repo = git.Repo(self.root)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise UserError(f"{self.root}: not a git repository") from None

    # -------------------------------------------------------------- revisions

    def resolve(self, rev: str) -> str:
        """The full sha of a revision (sha, branch, tag); `UserError` naming it if it is none."""
        try:
            return self.repo.commit(rev).hexsha
        except (git.BadName, ValueError, git.GitCommandError):
            raise UserError(f"unknown branch or commit {rev!r} in {self.root}") from None

    def resolve_many(self, revs: list[str]) -> dict[str, str | UserError]:
        """The full sha of each revision in one `git rev-parse` (`standings` resolves every champion's
        tag: a year's are hundreds); a revision that is none maps to the `UserError` `resolve` gives."""
        if not revs:
            return {}
        shas: list[str] = []
        if not any(r.startswith("-") for r in revs):  # (git 2.39's rev-parse has no --end-of-options)
            try:
                shas = self.repo.git.rev_parse(*(f"{r}^{{commit}}" for r in revs)).split()
            except git.GitCommandError:
                shas = []
        if len(shas) == len(revs) and all(_FULL_SHA.fullmatch(x) for x in shas):
            return dict(zip(revs, shas))
        out: dict[str, str | UserError] = {}
        for rev in revs:  # one is not there: each on its own, to name it
            try:
                out[rev] = self.resolve(rev)
            except UserError as e:
                out[rev] = e
        return out

    def tree(self, rev: str) -> str:
        """The tree of `rev`; a full sha's is kept (a commit's tree never changes: the check that a
        candidate was not measured before compares it with every earlier hypothesis's)."""
        key = (str(self.root), rev)
        known = _trees.get(key)  # (never a check then a read: another thread may clear it between)
        if known is not None:
            return known
        tree = self.repo.commit(rev).tree.hexsha
        if _FULL_SHA.fullmatch(rev):
            if len(_trees) >= 100_000:
                _trees.clear()
            _trees[key] = tree
        return tree

    def trees(self, revs: list[str]) -> dict[str, str]:
        """`tree` of many revisions at once: the full shas not known yet in one `git log --no-walk` (a
        year of hypotheses read one `cat-file` each was 5-8 s for the first duplicate check). A
        revision this repository lacks is left out."""
        out: dict[str, str] = {}
        todo = []
        for rev in dict.fromkeys(revs):
            known = _trees.get((str(self.root), rev))
            if known is not None:
                out[rev] = known
            elif _FULL_SHA.fullmatch(rev):
                todo.append(rev)
            elif (t := self._tree_or_none(rev)) is not None:  # a name: resolved alone
                out[rev] = t
        if todo:
            proc = subprocess.run(["git", "-c", "log.showSignature=false", "log", "--no-walk=unsorted", "--format=%H %T",
                                   "--ignore-missing", "--stdin"], cwd=self.root,
                                  input="\n".join(todo) + "\n", capture_output=True, text=True)
            got = proc.stdout if proc.returncode == 0 else \
                "\n".join(f"{rev} {t}" for rev in todo if (t := self._tree_or_none(rev)))  # one it lacks: one at a time
            for line in got.splitlines():
                sha, _, tree = line.partition(" ")
                if tree:
                    out[sha] = _trees[(str(self.root), sha)] = tree
            if len(_trees) >= 100_000:
                _trees.clear()
        return out

    def _tree_or_none(self, rev: str) -> str | None:
        try:
            return self.tree(rev)
        except (git.BadName, ValueError, git.GitCommandError):
            return None

    # -------------------------------------------------------------- the baseline

    def baseline_head(self) -> str:
        return self.repo.commit(BASELINE_BRANCH).hexsha

    def baseline_tags(self) -> list[str]:
        """Every `baseline/vN` tag, by name (git's list, not every tag of the repository read)."""
        return [t for t in self._tag_names(BASELINE_TAGS) if baseline_number(t) is not None]

    def _tag_names(self, pattern: str) -> list[str]:
        return self.repo.git.for_each_ref("--format=%(refname:lstrip=2)", f"refs/tags/{pattern}").split()

    def tag_commits(self, names: list[str]) -> dict[str, str]:
        """The commit of each tag of `names`, in one `git rev-parse` (one at a time if one is gone)."""
        if not names:
            return {}
        try:
            shas = self.repo.git.rev_parse(*(f"refs/tags/{n}^{{commit}}" for n in names)).split()
        except git.GitCommandError:
            return {n: c for n in names if (c := self._tag_commit(n)) is not None}
        return dict(zip(names, shas))

    def _tag_commit(self, name: str) -> str | None:
        """The commit tag `name` points at (through an annotated tag), None when there is no such tag.
        One ref looked up, where GitPython's `repo.tags` reads them all (0.2 s at a year's 17,000)."""
        try:
            return self.repo.git.rev_parse("--verify", "--quiet", f"refs/tags/{name}^{{commit}}") or None
        except git.GitCommandError:
            return None

    def baseline_tag(self, commit: str) -> str | None:
        """The newest `baseline/vN` tag at `commit` (None if it was never a promoted baseline)."""
        try:  # git's own filter: reading every tag object was a quarter second at a year of promotions
            names = self.repo.git.tag("--points-at", commit, "--list", BASELINE_TAGS).split()
        except git.GitCommandError:  # not a commit of this repository
            return None
        at = [name for name in names if baseline_number(name) is not None]
        return max(at, key=lambda name: baseline_number(name) or 0, default=None)

    def baseline_name(self, commit: str) -> str:
        """How to name a baseline commit to a human: its tag, or `autoresearch/baseline@<sha>`."""
        return self.baseline_tag(commit) or f"{BASELINE_BRANCH}@{commit[:10]}"

    def generation(self, commit: str) -> int:
        """How many promotions (tags `baseline/vN`) the commit's history holds: 0 for the first baseline."""
        return generation(str(self.root), commit)

    # -------------------------------------------------------------- tags

    def tagged(self, name: str) -> tuple[str, str] | None:
        """(commit, message) of tag `name`, or None when there is no such tag."""
        commit = self._tag_commit(name)
        if commit is None:
            return None
        ref = git.TagReference(self.repo, f"refs/tags/{name}")
        return commit, (ref.tag.message if ref.tag is not None else "")

    def tag(self, name: str, commit: str, message: str | None = None) -> None:
        """Create tag `name` at `commit`; re-tagging the same commit is a no-op."""
        existing = self._tag_commit(name)
        if existing == commit:
            return
        if existing is not None:
            raise ValueError(f"tag {name} already points at {existing[:10]}")
        if message:
            self.repo.create_tag(name, ref=commit, message=message)
        else:
            self.repo.create_tag(name, ref=commit)

    def _next_baseline_tag(self, commit: str, message: str) -> str:
        """The commit's `baseline/vN` tag: the one it has, or the next number, made now."""
        existing = self.baseline_tag(commit)
        if existing:
            return existing
        numbers = [n for t in self.baseline_tags() if (n := baseline_number(t)) is not None]
        name = f"{BASELINE_TAG_PREFIX}{max(numbers, default=0) + 1}"
        self.tag(name, commit, message)
        return name

    # -------------------------------------------------------------- merges

    def promote(self, commit: str, message: str, *, base: str) -> tuple[str, str]:
        """Move the baseline branch to `commit`, the commit the gate measured against `base`, and tag
        it `baseline/vN`. Idempotent: a commit already in the baseline's history is its tag.

        Only a fast-forward from `base`: the new baseline's tree is the one measured, never a merge
        made here. A baseline that moved since (`base` no longer its head), or a commit that does not
        contain `base`, is refused (`PromotionConflict`): the caller re-bases it and measures it
        again. The branch moves only from the head read here (`git update-ref NEW OLD`).
        """
        head = self.baseline_head()
        if self.repo.is_ancestor(commit, head):  # already promoted (a re-run of this node)
            return head, self._next_baseline_tag(head, message)  # its tag, or one made now
        if head != base:
            raise PromotionConflict(f"{commit[:10]} was measured against {base[:10]}, but the baseline is now "
                                    f"{head[:10]}: not promoted without a comparison with it")
        if not self.repo.is_ancestor(head, commit):
            raise PromotionConflict(f"{commit[:10]} does not contain the baseline {head[:10]} it was measured "
                                    "against: promoting it would take a merge the gate never measured")
        self.repo.git.update_ref(f"refs/heads/{BASELINE_BRANCH}", commit, head)
        return commit, self._next_baseline_tag(commit, message)

    def maintain(self, timeout_s: float = 600) -> list[str]:
        """Keep a repository that gains a branch and a tag per hypothesis small and quick for years:
        its refs packed into one file (`git pack-refs --all`: the loop's plumbing leaves each a loose
        file of a disk block: 129 MB, and a third of a second for `git tag --points-at`, at a year's
        32,000), then its loose objects packed when git's own threshold says so (`git gc --auto`,
        which git runs after a porcelain `git commit` but never after the plumbing; it respects the
        repository's `gc.auto`, and detaches itself to work in the background unless
        `gc.autoDetach` is false). What was done, in lines; a git that fails says so in a line."""
        done = []
        for argv in (["git", "pack-refs", "--all"], ["git", "gc", "--auto", "--quiet"]):
            t0 = time.monotonic()
            try:
                proc = subprocess.Popen(argv, cwd=self.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            except OSError as e:
                done.append(f"{' '.join(argv[1:])}: {e}")
                continue
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:  # SIGTERM: git removes its lock files then (SIGKILL would leave them)
                proc.terminate()
                out, err = proc.communicate()
                done.append(f"{' '.join(argv[1:])}: stopped after {timeout_s:.0f} s")
                continue
            said = (err or out).strip().splitlines()  # a warning too (gc's last failure, from its gc.log)
            done.append(f"{' '.join(argv[1:])}: " + (f"{time.monotonic() - t0:.1f} s" if proc.returncode == 0 else
                                                     f"exit {proc.returncode}")
                        + (f" ({said[-1][:200]})" if said else ""))
        return done

    def remeasure(self, head: str, message: str) -> str:
        """Move the baseline branch from `head` to a new commit with `head`'s tree (an empty commit):
        the same code, measured again from its first run (results are per commit), in the
        environment the loop runs in now. Only from `head` (`git update-ref NEW OLD`): a baseline
        that moved since is refused (`PromotionConflict`). Its generation is `head`'s (no tag), so
        its runs and its challengers' keep the seed block."""
        tree = self.repo.commit(head).tree.hexsha
        commit = self.repo.git.commit_tree(tree, "-p", head, "-m", message)
        try:
            self.repo.git.update_ref(f"refs/heads/{BASELINE_BRANCH}", commit, head)
        except git.GitCommandError as e:
            raise PromotionConflict(f"the baseline moved from {head[:10]} while it was to be re-measured: "
                                    f"{str(e).splitlines()[-1][:200]}") from None
        return commit

    def merge_onto(self, head: str, commit: str, message: str) -> str:
        """`commit` merged onto `head` without a working tree (`git merge-tree`): a merge commit whose
        first parent is `head` (so `commit` stays in its history), or `commit` itself when it already
        contains `head`. Nothing but objects is written: no ref moves here. Deterministic: its dates
        are the later parent's, so the same (head, commit, message) gives the same commit and a
        re-run finds it instead of making another. `PromotionConflict` names the conflicting paths.
        It follows renames, as git's merges do (git 2.39's `merge-tree` cannot be told not to): a
        change to a file the other side moved lands at the new path, so the caller checks the merged
        tree's paths, not the inputs' (`agent.workspace.Workspace.check_tree`)."""
        if self.repo.is_ancestor(head, commit):
            return commit
        status, out, err = self.repo.git.merge_tree("--write-tree", "--name-only", head, commit,
                                                    with_extended_output=True, with_exceptions=False)
        if status == 1:  # conflicts: the tree id, the conflicted paths, a blank line, git's messages
            head_part, _, messages = out.partition("\n\n")
            paths = list(dict.fromkeys(line for line in head_part.splitlines()[1:] if line))
            kinds = [line for line in messages.splitlines() if line.startswith("CONFLICT")]
            raise PromotionConflict(f"{commit[:10]} conflicts with {head[:10]} in {', '.join(paths) or '?'}"
                                    + (f" ({'; '.join(kinds)})" if kinds else ""))
        if status != 0:
            raise git.GitCommandError(["git", "merge-tree", head, commit], status, err, out)
        tree = out.splitlines()[0]
        when = max(self.repo.commit(head).committed_date, self.repo.commit(commit).committed_date)
        date = f"{when} +0000"
        return self.repo.git.commit_tree(tree, "-p", head, "-p", commit, "-m", message,
                                         env={"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date})


# ----------------------------------------------------------------------------- generations

_generations: dict[tuple[str, str, Any], int] = {}
_trees: dict[tuple[str, str], str] = {}  # (root, full sha) → its tree (`LabRepo.tree`)


def generation(root: str, commit: str) -> int:
    """How many promotions (tags baseline/v*) the commit's history holds: 0 for the first baseline.

    A challenger's commit gains a generation when it is promoted (fast-forward), so the answer is
    cached per (commit, the state of the repository's baseline tags: their folder's listing and the
    packed refs' change time), never per commit alone."""
    tags = _tags_state(root)
    key = (root, commit, tags)
    if tags is None or key not in _generations:
        n = len(git.Repo(root).git.tag("--merged", commit, "--list", BASELINE_TAGS).split())
        if tags is None:
            return n
        if len(_generations) > 10_000:
            _generations.clear()
        _generations[key] = n
    return _generations[key]


def generations(root: str, commits: list[str]) -> None:
    """`generation` of many commits (full shas) at once, into its cache: one walk of their history
    instead of a `git tag --merged` each (a year of promotions made that 150 ms a commit: a minute for
    `status`). Each commit's baseline tags are found as a bit set, its parents' or-ed in, from the
    oldest commit to the newest; what this cannot tell is left to `generation`."""
    tags = _tags_state(root)
    todo = sorted({c for c in commits if (root, c, tags) not in _generations})
    if tags is None or not todo:
        return
    repo = git.Repo(root)
    try:
        bits: dict[str, int] = {}
        refs = repo.git.for_each_ref("--format=%(refname)", "refs/tags/" + BASELINE_TAG_PREFIX.rsplit("/", 1)[0])
        names = [r for r in refs.splitlines() if fnmatch.fnmatchcase(r.removeprefix("refs/tags/"), BASELINE_TAGS)]
        # each tag's commit, through any tags of tags, in one call
        targets = repo.git.rev_parse(*(f"{name}^{{commit}}" for name in names)).split() if names else []
        for i, sha in enumerate(targets):
            bits[sha] = bits.get(sha, 0) | (1 << i)
        reach: dict[str, int] = {}
        for line in repo.git.rev_list("--topo-order", "--reverse", "--parents", *todo).splitlines():
            sha, *parents = line.split()
            r = bits.get(sha, 0)
            for p in parents:
                r |= reach.get(p, 0)
            reach[sha] = r
    except git.GitCommandError:
        return  # a commit not in this clone: `generation` says so, one at a time
    finally:
        repo.close()
    if len(_generations) + len(todo) > 10_000:
        _generations.clear()
    for c in todo:
        if c in reach:
            _generations[(root, c, tags)] = reach[c].bit_count()


def _tags_state(root: str) -> Any:
    """What the baseline tags of the repository at `root` are, cheaply (no git process), or None
    where it cannot be told (a lab that is itself a linked worktree: its .git is a file)."""
    gitdir = os.path.join(root, ".git")
    if not os.path.isdir(gitdir):
        return None
    folder = os.path.join(gitdir, "refs", "tags", BASELINE_TAG_PREFIX.split("/")[0])
    try:
        names = tuple(sorted(os.listdir(folder)))
    except FileNotFoundError:
        names = ()
    except OSError:
        return None
    try:
        packed = os.stat(os.path.join(gitdir, "packed-refs")).st_mtime_ns
    except FileNotFoundError:
        packed = None
    return names, packed


def root_commits(root: Path) -> set[str] | None:
    """The first commits of the history of the lab's checked-out branch: the lab's identity, the same
    in every clone of it and on every branch made from it; None where they cannot be known (no git
    repository, no commit, a shallow clone: its first commit is where the clone was cut)."""
    try:
        repo = git.Repo(root)
        if repo.git.rev_parse("--is-shallow-repository").strip() == "true":
            return None
        return set(repo.git.rev_list("--max-parents=0", "HEAD").split()) or None
    except (git.GitCommandError, git.InvalidGitRepositoryError, git.NoSuchPathError, ValueError):
        return None


def in_history(root: Path, commit: str) -> bool:
    """Whether `commit` is in the history of the lab's checked-out branch."""
    try:
        git.Repo(root).git.merge_base("--is-ancestor", commit, "HEAD")
        return True
    except (git.GitCommandError, git.InvalidGitRepositoryError, git.NoSuchPathError, ValueError):
        return False


_local = threading.local()  # per thread: a git.Repo's helper processes are not to be shared between threads
_FULL_SHA = re.compile(r"[0-9a-f]{40}")


def _thread_repo(root: Path) -> LabRepo:
    """This thread's one `LabRepo` of the lab at `root` (not a new repository object and its helper
    processes per call); a process that opens many labs (a test run) keeps helpers for 4."""
    repos = _local.__dict__.setdefault("repos", {})
    repo = repos.pop(str(root), None)
    if repo is None:
        repo = LabRepo(root)
        while len(repos) >= 4:
            repos.pop(next(iter(repos))).repo.close()
    repos[str(root)] = repo  # most recently used last
    return repo


def resolve_commits(lab: Any, revs: list[str]) -> dict[str, str | UserError]:
    """`resolve_commit` of many revisions, in one git call (`LabRepo.resolve_many`, by this thread's
    one `LabRepo` of the lab); each maps to its sha or to the `UserError` that names it (all of them,
    where the lab is no repository)."""
    if not revs:
        return {}
    try:
        repo = _thread_repo(lab.root)
    except UserError as e:
        return {rev: e for rev in revs}
    return repo.resolve_many(revs)


def resolve_commit(lab: Any, rev: str) -> str:
    """The full sha of `rev` in `lab`'s repository. A full sha once found there is known from then on
    (commits do not change); a branch or tag is resolved each time, by this thread's one `LabRepo`
    of the lab."""
    known = _local.__dict__.setdefault("shas", set())
    key = (str(lab.root), rev)
    if key in known:
        return rev
    repo = _thread_repo(lab.root)
    sha = repo.resolve(rev)
    if sha == rev and _FULL_SHA.fullmatch(rev):
        known.add(key)
    return sha
