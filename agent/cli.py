"""The `autoresearch` command line: thin wrappers over `pipeline/` and `agent/`.

Start-up imports nothing heavy (no torch, peft, ray, langgraph): each command imports what it
needs inside its body. Data goes to stdout, progress and logs to stderr. Exit codes (`exit_code`):
0 ok; 2 bad input (a `UserError`, a policy this machine cannot run, a broken prompt template);
1 any other error the pipeline or the agent raises on purpose (an unreachable service, an LLM
endpoint down, an executor that cannot start). Either is one line on stderr, never a traceback; a
traceback is a bug.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from agent.errors import AgentError
from pipeline.api import PipelineError, UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Agent-driven autoresearch loop: hypotheses as branches, a multi-task benchmark, a statistical gate.",
)


export_app = typer.Typer(no_args_is_help=True, help="Export the lab's hypotheses and runs to other tools.")
app.add_typer(export_app, name="export")


def key_values(items: list[str] | None) -> dict[str, str]:
    """`--executor-option KEY=VALUE`s as a dict; one without `=` is a one-line error."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--executor-option {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


class Ctx:
    repo: Path = Path(".")
    db: str | None = None


@app.callback()
def _global(
    repo: Path = typer.Option(
        Path(os.environ.get("AUTORESEARCH_REPO", ".")), "--repo", help="The lab (env AUTORESEARCH_REPO)."
    ),
    db: Optional[str] = typer.Option(
        os.environ.get("AUTORESEARCH_DB"), "--db", help="Store URL (env AUTORESEARCH_DB; default SQLite in runs/)."
    ),
) -> None:
    Ctx.repo = repo
    Ctx.db = db


def emit_json(obj: object) -> None:
    """Stable JSON on stdout: sorted keys, no NaN surprises."""
    sys.stdout.write(json.dumps(obj, sort_keys=True, indent=2, default=str) + "\n")


@app.command()
def init(
    directory: Path = typer.Argument(..., help="Where to create the lab."),
    suite: Optional[str] = typer.Option(None, "--suite", help="Benchmark suite: small (8 tasks, CPU; the default) "
                                        "or full (24 tasks); sim for harness sim."),
    harness: str = typer.Option("transactions", "--harness",
                                help="transactions (the bundled benchmark), command (a skeleton of your own lab) "
                                     "or sim (a simulated lab, to try the loop at scale)."),
    force: bool = typer.Option(False, "--force", help="Create even if DIR exists and is not empty."),
    gpus: Optional[float] = typer.Option(None, "--gpus", help="[run] gpus of the lab: each stage's share of one GPU "
                                         "(0.25: four stages share a GPU) or whole GPUs (1..8); default: the template's (0)."),
) -> None:
    """Create a lab from a bundled template: a git repo with a baseline branch."""
    from agent.labinit import default_suite, init_lab
    from pipeline.api import harness_suites

    suite = suite or default_suite(harness_suites(harness))  # chosen once, here: the message names it
    root = init_lab(directory, suite=suite, force=force, harness=harness, gpus=gpus)
    typer.echo(str(root))
    on = f", [run] gpus = {gpus:g}" if gpus is not None else ""
    typer.echo(f"lab created at {root} (suite {suite}{on}); baseline branch autoresearch/baseline", err=True)


@app.command("power")
def power_cmd(
    sigma: float = typer.Option(..., "--sigma", help="Per-run standard deviation of the metric (e.g. 0.02 AUC)."),
    baseline: int = typer.Option(..., "--baseline", help="Baseline runs."),
    challenger: list[int] = typer.Option(..., "--challenger", help="Challenger runs; repeat for several counts."),
    alpha: Optional[float] = typer.Option(None, "--alpha", help="Level (default 0.05 two-sided, 0.025 one-sided)."),
    two_sided: bool = typer.Option(False, "--two-sided", help="Two-sided test (the reference post's)."),
    effect: Optional[float] = typer.Option(
        None, "--effect", help="True improvement to compute the power at; its size counts, so a lower-is-better "
                               "metric's decrease may be given as negative."),
    target_power: float = typer.Option(0.95, "--power", help="Power at which the MDE is reported."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Power / minimum detectable effect of the pooled Student t (non-central t).

    JSON: {"mde", "power", "challenger"} for the first --challenger, and "rows" with one
    {"challenger", "df", "se", "mde", "power_at", "power"} per count; "power" is at --effect,
    or at the MDE when no effect is given.
    """
    from pipeline.api import power_plan as plan

    result = plan(sigma, baseline, challenger, alpha, two_sided, effect, target_power)
    if as_json:
        emit_json(result)
    else:
        from rich.console import Console

        from pipeline.api import power_table

        Console().print(power_table(result))


@app.command("gate-sim")
def gate_sim_cmd(
    protocol: str = typer.Option("paired", "--protocol", help="paired, sequential or fixed."),
    effect: float = typer.Option(0.0, "--effect", help="True improvement in σ units (0: false-positive rate)."),
    tasks: int = typer.Option(8, "--tasks", help="Tasks per hypothesis."),
    rho: float = typer.Option(0.0, "--rho", help="Cross-task correlation of a seed's runs (shared pretraining)."),
    trials: int = typer.Option(20_000, "--trials", help="Simulated hypotheses."),
    baseline_runs: int = typer.Option(10, "--baseline-runs", help="Baseline runs per task."),
    looks: Optional[str] = typer.Option(None, "--looks",
                                        help="Planned challenger run counts, comma-separated (default 1,2,5,10 "
                                             "for paired, else 2,5,10)."),
    alpha: Optional[float] = typer.Option(None, "--alpha",
                                          help="One-sided level (default the protocol's: 0.01 paired, else 0.025)."),
    futility_p: Optional[float] = typer.Option(None, "--futility-p",
                                               help="Escalate only while the one-sided p is below this (default "
                                                    "the protocol's: 0.20 paired, else 0.30)."),
    harm_q: float = typer.Option(0.10, "--harm-q", help="Benjamini-Hochberg q for per-task wins and harms."),
    history: int = typer.Option(0, "--history", help="Extra baseline-commit runs per task (variance prior)."),
    affected: Optional[int] = typer.Option(None, "--affected", help="Tasks carrying the effect (default: all)."),
    trim: float = typer.Option(0.125, "--trim", help="Horizontal statistic: share of tasks trimmed at each end."),
    seed: int = typer.Option(0, "--seed", help="RNG seed."),
    pair_rho: float = typer.Option(0.0, "--pair-rho",
                                   help="Correlation of the challenger's seed-k run with the baseline's (shared seeds)."),
    history_pair_rho: Optional[float] = typer.Option(None, "--history-pair-rho",
                                                     help="paired: the pairing of the lab's earlier comparisons "
                                                          "(default: --pair-rho)."),
    pair_history: int = typer.Option(10, "--pair-history", help="paired: earlier comparisons (2 pairs each)."),
    eager_baseline: bool = typer.Option(False, "--eager-baseline",
                                        help="paired: the gate sees every baseline run (default: the lazy baseline's)."),
    challenger_sd: float = typer.Option(1.0, "--challenger-sd",
                                        help="The challenger's per-run σ over the baseline's (a noisier branch)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Simulate a protocol: false-positive rate (effect 0) or power, and mean challenger runs.

    JSON: "false_positive_rate" (effect 0) or "power" (the rate of `improvement` verdicts) with its
    "_se", "mean_challenger_runs", horizontal and per-task crossing rates, "verdict_rates".
    """
    from pipeline.api import UserError, gate_protocol, simulate

    proto = gate_protocol(protocol)  # an unknown protocol: one line
    looks = ",".join(str(n) for n in proto.default_looks) if looks is None else looks  # unset: the protocol's own
    alpha = proto.default_alpha if alpha is None else alpha
    futility_p = proto.default_futility_p if futility_p is None else futility_p
    try:
        planned = tuple(int(x) for x in looks.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--looks: expected comma-separated integers, got {looks!r}") from None
    typer.echo(f"simulating {trials} trials ({protocol})...", err=True)
    result = simulate(
        protocol=protocol, effect=effect, tasks=tasks, rho=rho, trials=trials, baseline_runs=baseline_runs,
        looks=planned, alpha=alpha, futility_p=futility_p, harm_q=harm_q, history=history, affected=affected,
        horizontal_trim=trim, seed=seed, pair_rho=pair_rho, history_pair_rho=history_pair_rho,
        pair_history=pair_history, lazy=not eager_baseline, challenger_sd=challenger_sd,
    )
    if as_json:
        emit_json(result.to_json())
    else:
        from rich.console import Console

        from pipeline.api import sim_table

        Console().print(sim_table(result))


@app.command()
def check(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Validate the lab (research.toml, harness, tasks, editable files) and summarise it."""
    from agent.commands import check_lab

    summary, warnings = check_lab(Ctx.repo, dict(os.environ))
    if as_json:
        emit_json({**summary, "warnings": warnings})
    else:
        for key, value in summary.items():
            typer.echo(f"{key:11s} {', '.join(map(str, value)) if isinstance(value, list) else value}")
    for line in warnings:
        typer.echo(f"warning: {line}", err=True)


@app.command("seed")
def seed_cmd(
    text: Optional[str] = typer.Argument(None, help="The idea, in words."),
    title: Optional[str] = typer.Option(None, "--title", help="A short title (default: the first line)."),
    priority: int = typer.Option(10, "--priority", help="Higher goes first; agent proposals have 0."),
    branch: Optional[str] = typer.Option(None, "--branch", help="Evaluate this existing branch as-is."),
    file: Optional[Path] = typer.Option(None, "--file", help="The idea from a file (.md text, or .json with edits)."),
) -> None:
    """Queue a human hypothesis; prints its id."""
    from agent.commands import seed

    h = seed(Ctx.repo, Ctx.db, text, title, priority, branch, file)
    typer.echo(str(h.id))
    typer.echo(f"queued hypothesis {h.id}: {h.title}", err=True)


@app.command("run")
def run_cmd(
    max_hypotheses: int = typer.Option(3, "--max-hypotheses", min=1,
                                       help="Hypotheses to work on in this run (resumed ones count)."),
    hours: Optional[float] = typer.Option(None, "--hours", min=0.0, help="Stop after this many hours."),
    forever: bool = typer.Option(False, "--forever", help="Never stop on a count; wait for seeds when idle."),
    executor: str = typer.Option("local", "--executor", help="local or ray."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Run slots (default: cores / run.cpus)."),
    ray_address: Optional[str] = typer.Option(os.environ.get("RAY_ADDRESS"), "--ray-address", help="Ray cluster (env RAY_ADDRESS)."),
    executor_option: Optional[list[str]] = typer.Option(None, "--executor-option", metavar="KEY=VALUE",
                                                        help="An option of the executor's own (repeatable; a plugin's)."),
    offline: bool = typer.Option(False, "--offline", help="Use the offline policy even if an LLM is configured."),
    policy: Optional[str] = typer.Option(None, "--policy",
                                         help="A policy by name (llm, offline); default: the LLM if configured."),
    supervised: bool = typer.Option(False, "--supervised", help="Hold promotions until a human approves them."),
    as_json: bool = typer.Option(False, "--json", help="End with the run's outcome as JSON instead of a table."),
    mlflow: Optional[str] = typer.Option(None, "--mlflow", help="Export each hypothesis to this MLflow tracking URI "
                                                                  "as it is decided."),
    pause_on_plateau: bool = typer.Option(False, "--pause-on-plateau",
                                          help="Stop when [agent] plateau_after hypotheses in a row were not promoted."),
    notify: Optional[list[str]] = typer.Option(None, "--notify",
                                               help="Also notify this target (repeatable): https://… (JSON webhook), "
                                                    "slack+https://…, smtp://host:port?to=…&from=…"),
) -> None:
    """The autonomous loop: propose, implement, measure, decide, summarize."""
    import logging

    from agent.loop import ENVIRONMENT_CHANGED, Loop, LoopOptions
    from agent.terminal import RunDisplay
    from agent.config import open_lab
    from pipeline.api import ExecutorOptions, check_executor

    check_executor(executor)  # an unknown name: one line before the lab is read
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    lab = open_lab(Ctx.repo)
    opts = LoopOptions(max_hypotheses=max_hypotheses, hours=hours, forever=forever,
                       executor=ExecutorOptions(executor, workers, ray_address, extra=key_values(executor_option)),
                       offline=offline, policy=policy, supervised=supervised,
                       pause_on_plateau=pause_on_plateau, mlflow=mlflow, db=Ctx.db, notify=tuple(notify or ()))
    display = RunDisplay()
    loop = Loop(lab, opts, progress=display.say, looks=display.looks if display.tty else None)
    loop.install_signals()
    try:
        out = loop.run()
    finally:
        display.close()
        loop.close()
    if as_json:
        emit_json(out)
    else:
        display.decided(out["this_run"], out.get("stopped"))
    if out.get("stopped") == "LLM unreachable":
        raise typer.Exit(1)  # said in one line by the loop; the store holds no hypothesis for it
    if out.get("stopped") == ENVIRONMENT_CHANGED:
        raise typer.Exit(3)  # a supervisor starts it again: the new start re-measures the baseline


@app.command("serve")
def serve_cmd(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (off loopback: --token or --generate-token)."),
    port: int = typer.Option(8765, "--port", min=1, max=65535),
    token: Optional[str] = typer.Option(os.environ.get("AUTORESEARCH_TOKEN"), "--token",
                                        help="Access token (env AUTORESEARCH_TOKEN; default: the lab's runs/serve.token)."),
    generate_token: bool = typer.Option(False, "--generate-token",
                                        help="Off loopback: use the lab's own token (runs/serve.token, made if absent)."),
) -> None:
    """The review page in a browser: overview, hypotheses, summaries, approve/reject/comment."""
    from agent.web import serve

    serve(Ctx.repo, Ctx.db, host, port, token, generate_token, say=lambda m: typer.echo(m, err=True))


@export_app.command("mlflow")
def export_mlflow(
    tracking_uri: Optional[str] = typer.Option(
        os.environ.get("MLFLOW_TRACKING_URI"), "--tracking-uri",
        help="MLflow tracking URI (env MLFLOW_TRACKING_URI; default sqlite:///<lab>/runs/mlflow.db)."),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="Experiment name (default autoresearch/<lab>)."),
) -> None:
    """One MLflow run per hypothesis (changed config keys, verdict, decision, Δs, summary, forest plot)
    and a nested run per (task, seed); idempotent. Exit code 1 when the server refused one (`failed`)."""
    from agent.commands import open_lab_store
    from agent.mlflow_export import default_tracking_uri, export

    lab, store, _rec = open_lab_store(Ctx.repo, Ctx.db)
    uri = tracking_uri or default_tracking_uri(lab)
    out = export(lab, store, uri, experiment)
    emit_json({"tracking_uri": uri, **out})
    if out["failed"]:  # the JSON says which and why; a script or cron job must see it too
        raise typer.Exit(1)


@app.command("status")
def status_cmd(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Queue, in-flight runs, hypotheses with verdicts, compute, goodput, LLM spend."""
    from agent.commands import status

    st = status(Ctx.repo, Ctx.db)
    if as_json:
        emit_json(st)
        return
    from agent.views import print_status

    print_status(st)


@app.command("report")
def report_cmd(
    hypothesis: int = typer.Argument(..., help="Hypothesis id."),
    as_json: bool = typer.Option(False, "--json"),
    as_md: bool = typer.Option(False, "--md"),
) -> None:
    """The gate's table for one hypothesis (latest look)."""
    from agent.commands import report

    h, result, replication = report(Ctx.repo, Ctx.db, hypothesis)
    if as_json:
        emit_json({"hypothesis": {"id": h.id, "title": h.title, "status": h.status, "verdict": h.verdict,
                                  "decision": h.decision}, "gate": result.to_json() if result else None,
                   "replication": replication})
        return
    if result is None:
        typer.echo(f"hypothesis {h.id} ({h.status}) has no gate result yet")
        return
    from pipeline.api import render_markdown, render_replication, render_table

    if as_md:
        from agent.views import report_markdown

        md = render_markdown(result) + (f"\n\n{render_replication(replication)}" if replication else "")
        typer.echo(report_markdown(Ctx.repo, h, md))
    else:
        from rich.console import Console

        Console().print(render_table(result))
        if replication:
            typer.echo(f"replication: {replication['reason']}")


@app.command("review")
def review_cmd(
    hypothesis: Optional[int] = typer.Argument(None, help="Hypothesis id (omit to list what awaits review)."),
    approve: bool = typer.Option(False, "--approve"),
    reject: bool = typer.Option(False, "--reject"),
    comment: Optional[str] = typer.Option(None, "--comment", help="A comment; it joins the agent's context."),
) -> None:
    """Human review: list pending summaries, approve, reject, comment."""
    from agent.commands import review

    out = review(Ctx.repo, Ctx.db, hypothesis, approve, reject, comment)
    if "pending" in out:
        for p in out["pending"]:
            typer.echo(f"{p['id']:>4}  {p['decision'] or p['status']:<9} {p['verdict'] or '-':<12} {p['title']}  ({p['summary']})")
        if not out["pending"]:
            typer.echo("nothing awaits review", err=True)
    else:
        emit_json(out)


@app.command("digest")
def digest_cmd(
    since: str = typer.Option("24h", "--since", help="How far back: 24h, 90m, 7d."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What was tried, promoted and abandoned; compute, goodput and LLM spend."""
    from agent.commands import digest

    d = digest(Ctx.repo, Ctx.db, since)
    if as_json:
        emit_json(d)
        return
    from agent.views import digest_markdown

    typer.echo(digest_markdown(d))


@app.command("variance")
def variance_cmd(
    runs: int = typer.Option(10, "--runs", min=2, help="Identical baseline runs per task."),
    executor: str = typer.Option("local", "--executor", help="local or ray."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1),
    ray_address: Optional[str] = typer.Option(os.environ.get("RAY_ADDRESS"), "--ray-address"),
    executor_option: Optional[list[str]] = typer.Option(None, "--executor-option", metavar="KEY=VALUE",
                                                        help="An option of the executor's own (repeatable)."),
    pair: Optional[str] = typer.Option(None, "--pair", metavar="REV",
                                       help="Measure what the seeds buy: REV against the baseline, seed k with seed k."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The variance study: N identical baseline runs per task, per-task σ, correlation, MDE table;
    with --pair REV, per task the seed-k pair correlation of REV with the baseline, the sd of the
    paired differences and the variance ratio (a noise model for benchmarks/loop_quality.py)."""
    from agent.config import open_lab
    from pipeline.api import ExecutorOptions, open_store, pairing_study, variance_study

    lab = open_lab(Ctx.repo)
    store = open_store(lab, Ctx.db)
    options = ExecutorOptions(executor, workers, ray_address, extra=key_values(executor_option))
    if pair is not None:
        out = pairing_study(lab, store, pair, runs, options)
        if as_json:
            emit_json(out)
            return
        typer.echo(f"{'task':22s} {'pairs':>5s} {'corr':>6s} {'sd(d)':>8s} {'var ratio':>9s}")
        for task, t in out["tasks"].items():
            cells = [f"{t['pair_correlation']:6.2f}" if t["pair_correlation"] is not None else f"{'-':>6s}",
                     f"{t['sd_paired_difference']:8.4f}" if t["sd_paired_difference"] is not None else f"{'-':>8s}",
                     f"{t['variance_ratio']:9.2f}" if t["variance_ratio"] is not None else f"{'-':>9s}"]
            typer.echo(f"{task:22s} {t['pairs']:5d} " + " ".join(cells))
        med, ratio = out["median_pair_correlation"], out["median_variance_ratio"]
        typer.echo(f"median pair correlation {med:.2f}, median variance ratio {ratio:.2f} (paired / unpaired)"
                   if med is not None and ratio is not None else "pairing: n/a (fewer than 3 pairs)")
        return
    out = variance_study(lab, store, runs, options)
    if as_json:
        emit_json(out)
        return
    looks = lab.config.gate.looks
    typer.echo(f"{'task':22s} {'mean':>7s} {'sd':>7s} " + " ".join(f"{'MDE@' + str(m):>8s}" for m in looks))
    for task, t in out["tasks"].items():
        mdes = " ".join(f"{t['mde'][str(m)]:8.4f}" if t["mde"][str(m)] else f"{'-':>8s}" for m in looks)
        typer.echo(f"{task:22s} {t['mean'] or 0:7.4f} {t['sd'] or 0:7.4f} {mdes}")
    corr = out["mean_cross_task_correlation"]
    typer.echo(f"mean cross-task correlation across seeds: {corr:.2f}" if corr is not None else "correlation: n/a")


@app.command()
def trust(
    rev: Optional[str] = typer.Argument(None, help="Move the trusted commit here (a human's decision)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Show or move the trusted commit the harness files come from (`harness = "command"`)."""
    import git

    from agent.config import open_lab
    from pipeline.api import Experiment, open_store

    lab = open_lab(Ctx.repo)
    TRUSTED_TAG, sha = Experiment(lab, open_store(lab, Ctx.db)).trust(rev)
    commit = git.Repo(lab.root).commit(sha)
    info = {"tag": TRUSTED_TAG, "commit": sha, "subject": commit.summary, "trusted": lab.config.benchmark.trusted,
            "moved": rev is not None}
    if as_json:
        emit_json(info)
    else:
        typer.echo(f"{TRUSTED_TAG} = {sha[:12]} {commit.summary}")
        if rev is not None:
            typer.echo("moved: the harness files (and so the prepared data and the scorer) now come from this "
                       "commit; results measured before were scored by the previous ones", err=True)


GLOBAL_OPTIONS = ("--repo", "--db")


def hoist_global_options(argv: list[str]) -> list[str]:
    """`--repo`/`--db` are accepted after the command name too: move them before it.

    `autoresearch status --repo X` then means `autoresearch --repo X status`. Nothing after `--` moves.
    """
    cmd = 0
    while cmd < len(argv) and argv[cmd].startswith("-"):
        cmd += 2 if argv[cmd] in GLOBAL_OPTIONS else 1  # a global option's value is not the command
    hoisted: list[str] = []
    rest: list[str] = []
    i = cmd + 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg.split("=", 1)[0] in GLOBAL_OPTIONS and ("=" in arg or i + 1 < len(argv)):
            take = 1 if "=" in arg else 2
            hoisted += argv[i:i + take]
            i += take
            continue
        rest.append(arg)
        i += 1
    return argv[:cmd] + hoisted + argv[cmd:cmd + 1] + rest


def main() -> None:
    """Console-script entry point: user errors become one line and exit code 2.

    Usage errors (unknown command or option) are typer's own, also exit code 2.
    """
    sys.argv[1:] = hoist_global_options(sys.argv[1:])
    try:
        app()
    except (PipelineError, AgentError) as e:  # raised on purpose: one line, the code its class says
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
