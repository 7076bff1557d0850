"""What a user sees in TensorBoard: one short CPU run of every method's config, then a real TensorBoard server
(a subprocess) over one logdir holding every run, read over its HTTP API the way its dashboards read it.

* Runs: one config per LightningModule class (and the population-mode non-contrastive run), built by
  ``featlearn.cli.make_cli`` as ``lightning fit --config`` builds it, with tiny data overrides (the sizes of
  tests/gpu/test_methods_gpu.py), ``STEPS`` steps, ``log_every_n_steps`` ``EVERY``, the config's own TensorBoard
  logger pointed at a temporary directory (``version`` = the method's key here). What the Trainer hands the
  logger (``log_metrics``, ``log_hyperparams``) is recorded on the way, to compare with what the server shows.
* Server: ``python -m tensorboard.main --port 0 --load_fast=false --reload_interval 0 --reload_task blocking``:
  the OS picks the port (read from the server's banner), everything is loaded before it serves, and it is
  terminated (killed if need be) when the module's tests end.
* Endpoints (tensorboard 2.21): ``/data/runs``; SCALARS ``/data/plugin/scalars/tags`` and ``.../scalars``; the
  Time Series tab's ``/data/plugin/timeseries/tags``; IMAGES ``/data/plugin/images/tags``, ``.../images`` and
  ``.../individualImage``; HPARAMS ``/data/plugin/hparams/experiment``, ``.../session_groups`` and
  ``.../metric_evals`` (POST, JSON bodies as in tensorboard/plugins/hparams/api.proto).

Known defects are asserted as they should be and marked ``xfail(strict=True)``, so each flips once fixed:
``test_common_training_loss_tag`` (every method names its loss differently).
"""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml

from host_syncs import record_syncs
from tiny_sizes import ERM_NU, GEMFILTER, HIDDEN, ICL, ICL_PARITY, LOOPED, XOR, MODADD, MRP, PARITY, PATCHES, SPARSE, TRANSFORMER, VIT, over

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
STEPS = 4  # optimisation steps of every run
EVERY = 2  # trainer.log_every_n_steps: > 1, so a method that logs on other steps than Lightning writes shows up
WRITTEN = [s for s in range(STEPS) if (s + 1) % EVERY == 0]  # the steps Lightning writes: 1, 3
COMMON_TRAIN_LOSS = "train/loss"  # the one training-loss tag every method should write (see the last test)
HTTP_TIMEOUT = 30.0
SERVER_START_TIMEOUT = 90.0


HEATMAP = ("heatmap/correlation",)  # HeatmapLogger, every method, at the end of fit
# key: (run config, tiny overrides, the training loss's tag today, the learning-rate hparam, figure tags)
METHODS = {
    "mrp_teacher_student": ("mrp/teacher_student.yaml", MRP, "train/loss", "lr", HEATMAP),
    "mrp_mae": ("mrp/mae.yaml", MRP, "train/loss", "lr", HEATMAP),
    "mrp_supervised": ("mrp/supervised.yaml", MRP, "train/loss", "lr", HEATMAP),
    "contrastive": ("contrastive/random_mask.yaml", SPARSE, "train/loss", "lr", HEATMAP),
    "noncontrastive": ("noncontrastive/with_head.yaml", PATCHES, "train/loss", "lr", HEATMAP + ("heatmap/head",)),
    "noncontrastive_population": ("noncontrastive/with_head_population.yaml", PATCHES, "train/loss", "lr",
                                  HEATMAP + ("heatmap/head",)),
    "vit_mae": ("vit/mae.yaml", over(dict(VIT, K=2)), "train/loss", "lr",
                HEATMAP + ("heatmap/upsilon", "attention/areas", "attention/sample")),
    "vit_cl": ("vit/cl.yaml", over(dict(VIT, K=4, d=None)), "train/loss", "lr",
               HEATMAP + ("attention/areas", "attention/sample")),
    # the schedule's step sizes are multiples of the theory's (no plain lr): lr1_mult is the first step's
    "two_layer": ("two_layer/network.yaml", over(PARITY, dict(width=8, steps=600)), "train/loss", "lr1_mult",
                  HEATMAP + ("neurons/mds",)),
    "universality": ("universality/universal.yaml", HIDDEN, "train/loss", "lr", HEATMAP),
    "modular_addition": ("modular_addition/mlp.yaml", MODADD, "train/loss", "lr", HEATMAP),
    "modular_transformer": ("modular_addition/transformer.yaml", TRANSFORMER, "train/loss", "lr",
                            HEATMAP + ("heads/dft",)),
    "looped_transformer": ("looped_transformer/trained.yaml", LOOPED, "train/loss", "lr",
                           HEATMAP + ("heatmap/Q", "heatmap/P")),
    "icl_lsa": ("icl_scale/regression.yaml", ICL, "train/loss", "lr", HEATMAP),
    "icl_parity": ("icl_scale/parity.yaml", ICL_PARITY, "train/loss", "lr", HEATMAP),
    "gradient_features": ("gradient_features/xor.yaml", XOR, "train/loss", "lr", HEATMAP),
    "erm_nu": ("erm_nu/theory.yaml", ERM_NU, "train/loss", "lr", HEATMAP),
    "gemfilter": ("gemfilter/retrieval.yaml", GEMFILTER, "train/loss", "lr", HEATMAP),
}


# ---------------------------------------------------------------------------------------------------------
# the runs
# ---------------------------------------------------------------------------------------------------------
class Recorder:
    """What the Trainer and the module hand the TensorBoard logger, per log_dir."""

    def __init__(self):
        self.metrics = defaultdict(list)  # log_dir -> [(step, {tag: value})]
        self.hparams = {}  # log_dir -> (params as HPARAMS shows them, metrics) of the call with metrics

    def install(self, monkeypatch):
        from lightning.pytorch.loggers import TensorBoardLogger

        log_metrics, log_hyperparams = TensorBoardLogger.log_metrics, TensorBoardLogger.log_hyperparams

        def recording_log_metrics(logger, metrics, step=None):
            values = {k: _number(v) for k, v in metrics.items()}
            self.metrics[logger.log_dir].append((step, values))
            results = {k: v for k, v in values.items() if k.startswith("hp/")}
            if results:  # the run's results, beside the hyperparameters of its HPARAMS row
                self.hparams[logger.log_dir] = (self.hparams.get(logger.log_dir, ({}, {}))[0], results)
            return log_metrics(logger, metrics, step)

        def recording_log_hyperparams(logger, params, metrics=None, step=None):
            row = {k: shown(v) for k, v in dict(params).items() if not torch.is_tensor(v)}
            self.hparams[logger.log_dir] = (row, self.hparams.get(logger.log_dir, ({}, {}))[1])
            return log_hyperparams(logger, params, metrics, step)

        monkeypatch.setattr(TensorBoardLogger, "log_metrics", recording_log_metrics)
        monkeypatch.setattr(TensorBoardLogger, "log_hyperparams", recording_log_hyperparams)


def _number(value) -> float:
    return float(value.item() if torch.is_tensor(value) else value)


def shown(value):
    """A hyperparameter as the HPARAMS tab holds it: Lightning's sanitising (None and containers as text) and
    torch's summary (booleans and ints as numbers)."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    return value if isinstance(value, str) else str(value)


def fit_all(logdir: Path) -> dict:
    """Fit every method into ``logdir``: ``{key: {name, global_step, metrics, params, final} or {error}}``."""
    from featlearn.cli import make_cli

    recorder, done = Recorder(), {}
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recorder.install(mp)
        watched = record_syncs(mp)
        for key, (config, tiny, *_) in METHODS.items():
            args = ["fit", "--config", str(CONFIGS / config), *tiny, "--trainer.max_steps", str(STEPS),
                    "--trainer.log_every_n_steps", str(EVERY), "--trainer.accelerator", "cpu",
                    "--trainer.devices", "1",
                    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                    "--trainer.logger.init_args.save_dir", str(logdir),
                    "--trainer.logger.init_args.version", key,
                    "--heatmap.every_n_steps", "1000",  # the heat maps of the end of fit only
                    "--checkpoint.every_n_train_steps", "0", "--checkpoint.save_last", "false"]
            try:
                cli = make_cli(args)
            except BaseException as err:  # noqa: BLE001 - one method's failure fails its own tests only
                done[key] = {"error": repr(err)}
                continue
            log_dir = cli.trainer.logger.log_dir
            params, final = recorder.hparams.get(log_dir, ({}, {}))
            done[key] = {"name": Path(log_dir).relative_to(logdir).as_posix(),  # TensorBoard's run name
                         "global_step": cli.trainer.global_step, "metrics": recorder.metrics[log_dir],
                         "params": params, "final": final,
                         "host_syncs": {"steps": 0, "syncs": {}, **watched.get(id(cli.model), {})}}
    return done


class Run:
    def __init__(self, key, record: dict):
        self.key = key
        self.name, self.global_step = record["name"], record["global_step"]
        self.metrics = record["metrics"]  # [(step, {tag: value})] as handed to the logger
        self.params, self.final = record["params"], record["final"]  # the hparams row and its hp/ results
        self.host_syncs = record["host_syncs"]  # steps watched and the host syncs found in them (host_syncs.py)

    def series(self, tag) -> list[tuple[int, float]]:
        return [(step, values[tag]) for step, values in self.metrics if tag in values]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every method's short run, all in one logdir: ``(logdir, {key: Run or the error its fit raised})``.

    Under pytest-xdist the workers share one set of runs (the first to get here fits, the others wait for
    it), so ``pytest -n 2`` does not fit everything twice."""
    from filelock import FileLock

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = (tmp_path_factory.getbasetemp().parent / "tensorboard_server_runs" if worker
            else tmp_path_factory.mktemp("tensorboard_server_runs"))
    root.mkdir(parents=True, exist_ok=True)
    record = root / "runs.json"
    with FileLock(str(root / "fit.lock"), timeout=600):
        if not record.exists():
            record.write_text(json.dumps(fit_all(root / "logs")))
    done = json.loads(record.read_text())
    return root / "logs", {key: Run(key, r) if "error" not in r else r["error"] for key, r in done.items()}


def run_of(runs, key) -> Run:
    run = runs[1].get(key)
    if not isinstance(run, Run):
        pytest.fail(f"{key}: the fit raised {run}")
    return run


# ---------------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, url):
        self.url = url

    def get(self, path, **query):
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as response:
            return response.read()

    def get_json(self, path, **query):
        return json.loads(self.get(path, **query))

    def post_json(self, path, body: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
            return json.loads(response.read())

    # the HPARAMS dashboard's requests
    def experiment(self):
        return self.post_json("/data/plugin/hparams/experiment", {"experimentName": ""})

    def session_groups(self):
        return self.post_json("/data/plugin/hparams/session_groups", {
            "experimentName": "", "startIndex": 0, "sliceSize": 10000, "colParams": [],
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]})

    def metric_evals(self, session, tag):
        return self.post_json("/data/plugin/hparams/metric_evals", {
            "experimentName": "", "sessionName": session, "metricName": {"tag": tag, "group": ""}})


@pytest.fixture(scope="module")
def server(runs, tmp_path_factory):
    """A real TensorBoard over the runs' logdir; terminated (killed if it does not exit) afterwards."""
    logdir = runs[0]
    home = tmp_path_factory.mktemp("tb_server")  # its TMPDIR (.tensorboard-info) and its log
    log_path = home / "tensorboard.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
             "--port", "0", "--load_fast=false", "--reload_interval", "0", "--reload_task", "blocking"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=home,
            env={**os.environ, "TMPDIR": str(home)})
    try:
        deadline, port = time.monotonic() + SERVER_START_TIMEOUT, None
        while port is None:
            banner = re.search(r"http://127\.0\.0\.1:(\d+)/", log_path.read_text())
            if banner:
                port = int(banner.group(1))
            elif process.poll() is not None:
                pytest.fail(f"tensorboard exited with {process.returncode}:\n{log_path.read_text()}")
            elif time.monotonic() > deadline:
                pytest.fail(f"tensorboard did not start in {SERVER_START_TIMEOUT} s:\n{log_path.read_text()}")
            else:
                time.sleep(0.1)
        tb = Server(f"http://127.0.0.1:{port}")
        while True:  # the data is loaded before the banner (blocking reload); wait until it answers
            try:
                tb.get_json("/data/runs")
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"tensorboard does not answer:\n{log_path.read_text()}")
                time.sleep(0.1)
        yield tb
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@pytest.fixture(scope="module")
def scalar_tags(server):
    return server.get_json("/data/plugin/scalars/tags")


@pytest.fixture(scope="module")
def session_groups(server):
    return {g["name"]: g for g in server.session_groups()["sessionGroups"]}


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def config_value(path: Path, dotted: str):
    """A config's value of ``model.init_args.lr``-style keys, following ``config:`` (the nested config, which
    the file's own keys override); KeyError where no file sets it."""
    text = yaml.safe_load(path.read_text())
    if dotted in text:
        return text[dotted]
    node = text
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
    else:
        return node
    if "config" in text:
        return config_value(path.parent / text["config"], dotted)
    raise KeyError(f"{dotted} in {path}")


def same(got: float, want: float) -> bool:
    """Equal up to the float32 the event files store scalars in."""
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-37) or (math.isnan(got) and math.isnan(want))


# ---------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------
def test_every_run_is_listed(runs, server):
    names = {run_of(runs, key).name for key in METHODS}
    listed = set(server.get_json("/data/runs"))
    assert names <= listed, f"runs missing from /data/runs: {sorted(names - listed)}"


@pytest.mark.parametrize("key", list(METHODS))
def test_training_scalars(runs, server, scalar_tags, key):
    """The run has training scalars (SCALARS and Time Series tabs); its loss is there at every step Lightning
    writes (``WRITTEN``), finite, with the values the module logged."""
    run = run_of(runs, key)
    tags = set(scalar_tags.get(run.name, {}))
    loss_tag = COMMON_TRAIN_LOSS if COMMON_TRAIN_LOSS in tags else METHODS[key][2]  # the name today, until renamed
    training = {t for t in tags if t != "epoch" and not t.startswith("hp/")}
    assert training, f"{run.name}: no training scalars in the SCALARS tab (tags: {sorted(tags)})"
    assert loss_tag in tags, f"{run.name}: no {loss_tag} (tags: {sorted(tags)})"
    timeseries = server.get_json("/data/plugin/timeseries/tags")["scalars"]["runTagInfo"]
    assert loss_tag in timeseries.get(run.name, []), f"{run.name}: {loss_tag} not in the Time Series tab"

    points = server.get_json("/data/plugin/scalars/scalars", run=run.name, tag=loss_tag)
    steps, values = [p[1] for p in points], [p[2] for p in points]
    logged = run.series(loss_tag)
    assert steps == WRITTEN == [s for s, _ in logged], \
        f"{run.name} {loss_tag}: steps {steps}, logged at {[s for s, _ in logged]}"
    assert all(math.isfinite(v) for v in values), f"{run.name} {loss_tag}: {values}"
    assert all(same(v, w) for v, (_, w) in zip(values, logged)), \
        f"{run.name} {loss_tag}: the server shows {values}, the module logged {[w for _, w in logged]}"
    for tag in training:  # every training scalar: finite, at logged steps
        points = server.get_json("/data/plugin/scalars/scalars", run=run.name, tag=tag)
        assert points and {p[1] for p in points} <= {s for s, _ in run.series(tag)}, f"{run.name} {tag}: {points}"


@pytest.mark.parametrize("key", list(METHODS))
def test_figures(runs, server, key):
    """Each figure tag of the method is in the IMAGES tab, as a PNG, the heat map at the run's final step."""
    run, figures = run_of(runs, key), METHODS[key][4]
    tags = server.get_json("/data/plugin/images/tags").get(run.name, {})
    missing = set(figures) - set(tags)
    assert not missing, f"{run.name}: figures {sorted(missing)} not in the IMAGES tab (tags: {sorted(tags)})"
    for tag in figures:
        images = server.get_json("/data/plugin/images/images", run=run.name, tag=tag)
        assert images, f"{run.name} {tag}: no image"
        png = server.get(f"/data/plugin/images/individualImage?{images[-1]['query']}")
        assert png[:8] == b"\x89PNG\r\n\x1a\n", f"{run.name} {tag}: not a PNG"
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert width >= 100 and height >= 100, f"{run.name} {tag}: a {width}x{height} image"
    steps = [image["step"] for image in server.get_json("/data/plugin/images/images", run=run.name,
                                                       tag="heatmap/correlation")]
    assert steps[-1] == run.global_step == STEPS, f"{run.name}: heat maps at steps {steps}"


@pytest.mark.parametrize("key", list(METHODS))
def test_hparams_of_run(runs, server, session_groups, key):
    """The HPARAMS tab's row for the run: finished, the config's learning rate, every hyperparameter of the
    model and the data as logged, and its ``hp/*`` results (the curves the row expands to)."""
    run = run_of(runs, key)
    config, _, _, lr_name, _ = METHODS[key]
    assert run.final, f"{run.name}: no hp/ results were logged (final_metrics is empty)"
    group = session_groups.get(run.name)
    assert group is not None, f"{run.name}: no session group (groups: {sorted(session_groups)})"
    assert [s["status"] for s in group["sessions"]] == ["STATUS_SUCCESS"]
    hparams = group["hparams"]

    want_lr = config_value(CONFIGS / config, f"model.init_args.{lr_name}")
    assert lr_name in hparams, f"{run.name}: no {lr_name} in the HPARAMS row ({sorted(hparams)})"
    assert hparams[lr_name] == shown(want_lr), f"{run.name}: {lr_name} {hparams[lr_name]!r}, config {want_lr!r}"
    assert any(k.startswith("data.") for k in hparams), f"{run.name}: no data hyperparameters"
    wrong = {k: (hparams.get(k), v) for k, v in run.params.items() if hparams.get(k) != v}
    assert not wrong, f"{run.name}: hyperparameters (shown, logged): {wrong}"

    for tag, value in run.final.items():
        points = server.metric_evals(run.name, tag)
        assert points, f"{run.name}: no values of {tag}"
        assert same(points[-1][2], value), f"{run.name} {tag}: the server shows {points[-1][2]}, logged {value}"


def test_hparams_table_spans_every_method(runs, server, session_groups):
    """With every method's run in one logdir the HPARAMS table has every method's hyperparameters and ``hp/*``
    metrics as columns, and each row shows its own run's results."""
    done = [run_of(runs, key) for key in METHODS]
    experiment = server.experiment()
    columns = {h["name"] for h in experiment.get("hparamInfos", [])}
    metrics = {m["name"]["tag"] for m in experiment.get("metricInfos", [])}
    problems = []
    for run in done:
        if set(run.params) - columns:
            problems.append(f"{run.key}: hparam columns missing {sorted(set(run.params) - columns)[:5]}...")
        if set(run.final) - metrics:
            problems.append(f"{run.key}: metric columns missing {sorted(set(run.final) - metrics)[:5]}...")
        row = {m["name"]["tag"]: m["value"] for m in session_groups[run.name].get("metricValues", [])}
        wrong = [t for t, v in run.final.items() if t not in row or not same(row[t], v)]
        if wrong:
            problems.append(f"{run.key}: its row lacks or misstates {wrong[:5]}...")
    assert not problems, "\n".join(problems)


def test_final_metrics_at_final_step(runs, server):
    """The ``hp/*`` scalars (the run's final results) are at the run's final step, where its last heat map is."""
    wrong = {}
    for key in METHODS:
        run = run_of(runs, key)
        for tag in run.final:
            steps = [p[1] for p in server.get_json("/data/plugin/scalars/scalars", run=run.name, tag=tag)]
            if steps != [run.global_step]:
                wrong[f"{run.name} {tag}"] = steps
    assert not wrong, f"hp/ scalars not at the final step ({STEPS}): {dict(list(wrong.items())[:5])}"


_OTHER_LOSS_NAMES = [key for key, spec in METHODS.items() if spec[2] != COMMON_TRAIN_LOSS]


@pytest.mark.parametrize("key", [
    pytest.param(key, marks=pytest.mark.xfail(strict=True, reason=f"{key} logs its training loss as "
                                                                  f"{METHODS[key][2]}, not {COMMON_TRAIN_LOSS}: "
                                                                  "metric names follow no common pattern"))
    if key in _OTHER_LOSS_NAMES else key for key in METHODS])
def test_common_training_loss_tag(runs, scalar_tags, key):
    """Every method writes its training loss under one tag, so runs of different methods share one chart."""
    run = run_of(runs, key)
    tags = set(scalar_tags.get(run.name, {}))
    assert COMMON_TRAIN_LOSS in tags, f"{run.name}: no {COMMON_TRAIN_LOSS} (loss tags: " \
                                      f"{sorted(t for t in tags if 'loss' in t)})"


# every scalar tag: <section>/<name>[/<qualifier>...]; qualifiers may name a setting (k=2, view.single)
METRIC_NAME = re.compile(r"(train|val|test|theory|hp)(/[a-z0-9_]+)(/[a-z0-9_=.]+)*")


@pytest.mark.parametrize("key", list(METHODS))
def test_metric_names_follow_one_scheme(runs, scalar_tags, key):
    """Every scalar a method writes is ``train/...``, ``val/...``, ``test/...``, ``theory/...`` or ``hp/...``
    in lower-case segments, so the same quantity sits in the same place for every method in TensorBoard."""
    run = run_of(runs, key)
    odd = sorted(t for t in scalar_tags.get(run.name, {}) if t != "epoch" and not METRIC_NAME.fullmatch(t))
    assert not odd, f"{run.name}: tags outside the scheme {METRIC_NAME.pattern}: {odd}"


@pytest.mark.parametrize("key", list(METHODS))
def test_no_host_sync_between_logging_steps(runs, key):
    """A training step that logs nothing (here step 2 of 4, logging every 2) reads nothing from the device
    (tests/host_syncs.py: .item(), float(), bool(), .tolist(), boolean-mask indexing, nonzero, ...): on a GPU
    such a read makes the host wait for the device every step (docs/gpu.md), and it rules out CUDA graphs."""
    watched = run_of(runs, key).host_syncs
    assert watched["steps"] >= 1, "no step was watched: the hooks of tests/host_syncs.py did not run"
    assert not watched["syncs"], f"{key}: host syncs in a step that logs nothing: {sorted(watched['syncs'])}"
