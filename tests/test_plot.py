"""mla_tune.views.plot and `mla-tune report --plot`: the PNG opens and shows what its titles say."""

import json

import pytest
from typer.testing import CliRunner

from mla_tune.cli import app
from mla_tune.views.plot import plot_report, report_figure
from mla_tune.store.selection import TrialFilter
from mla_tune.views.report import build_report
from mla_tune.store.results import ResultsStore
from results_fixture import build_fixture_db

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture()
def fx(tmp_path):
    return build_fixture_db(tmp_path / "results.db")


def _titles(fig):
    out = [fig.get_suptitle()]
    for sf in fig.subfigs:
        out.append(sf.get_suptitle())
        out += [ax.get_title() for ax in sf.axes]
    return out


def test_figure_shows_what_its_titles_say(fx):
    import matplotlib.pyplot as plt

    with ResultsStore(fx.path) as s:
        rep = build_report(s, TrialFilter(device="NVIDIA H200"))
    fig = report_figure(rep)
    try:
        titles = _titles(fig)
        assert "kernel time vs context length per candidate, winner per bucket, % of roofline" in titles[0]
        assert any("NVIDIA H200" in t and "page 64" in t for t in titles)
        assert {t for t in titles if t.startswith("kernel time vs context length, batch")} == {
            "kernel time vs context length, batch 1", "kernel time vs context length, batch 8",
            "kernel time vs context length, batch 64"}
        assert any(t.startswith("winner per bucket (page 64)") for t in titles)
        assert any(t.startswith("winner's % of roofline floor (copy 4000 GB/s") for t in titles)
        # the time panels hold one line per valid candidate at the fixture's medians
        ax = next(a for sf in fig.subfigs for a in sf.axes if a.get_title().endswith("batch 8"))
        ys = sorted(round(float(line.get_ydata()[0]), 4) for line in ax.get_lines())
        w = next(w for w in rep.devices[0].workloads if (w.batch_size, w.context_len) == (8, 1024))
        assert ys == sorted(round(c.median_us, 4) for c in w.lines if c.ok)
        # the winner heatmap names the winner in every measured cell
        heat = next(a for sf in fig.subfigs for a in sf.axes if a.get_title().startswith("winner per bucket"))
        texts = [t.get_text() for t in heat.texts]
        assert sum(t.startswith("fa3 p64") for t in texts) == 5 and "not measured" in texts
    finally:
        plt.close(fig)


def test_png_opens(fx, tmp_path):
    import matplotlib.image as mpimg

    with ResultsStore(fx.path) as s:
        path = plot_report(build_report(s), tmp_path / "report.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] > 1000 and img.shape[1] > 1500      # three devices, stacked
    assert img[..., :3].std() > 0.05                          # not a blank canvas


def test_reference_only_says_no_roofline(fx):
    import matplotlib.pyplot as plt

    with ResultsStore(fx.path) as s:
        fig = report_figure(build_report(s, TrialFilter(device="cpu")))
    try:
        titles = _titles(fig)
        assert any("CPU torch reference, not a GPU kernel" in t for t in titles)
        assert "winner's % of roofline floor: not available" in titles
    finally:
        plt.close(fig)


def test_cli_plot_keeps_json_on_stdout(fx, tmp_path):
    png = tmp_path / "r.png"
    res = runner.invoke(app, ["report", "--db", str(fx.path), "--plot", str(png), "--format", "json",
                              "--device", "MetaX C500"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["devices"][0]["device_name"] == "MetaX C500"
    assert f"wrote {png}" in res.stderr and png.stat().st_size > 10_000
