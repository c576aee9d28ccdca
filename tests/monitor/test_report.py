"""The monitor's summary and chart, the comparison chart, and the check of a chart's path before any work."""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import PNG_SIGNATURE

from lightning_amp_plus.cli.chart import _comparison_figure, write_comparison_chart
from lightning_amp_plus.cli.compare import ConfigResult
from lightning_amp_plus.monitor.chart import _run_figure, check_chart_path, write_chart
from lightning_amp_plus.monitor.history import AmpHistory, StepEntry
from lightning_amp_plus.monitor.summary import summary

ROUTINE = "overflowed gradients"  # the monitor's kind for a step the scaler skipped


def fp16_run(skipped: set[int], steps: int = 20) -> AmpHistory:
    """A loss scale halving on each skipped step, as dynamic loss scaling does, from 2**16."""
    records, scale = [], 2.0**16
    for step in range(steps):
        records.append(StepEntry(step, scale, step in skipped, None if step in skipped else 1.0, None))
        scale /= 2 if step in skipped else 1
    return AmpHistory(records, [(step, ROUTINE, ["w"]) for step in sorted(skipped)])


# ------------------------------------------------------------------------------------------------------ summary
def test_overflows_are_listed_as_the_steps_they_were_not_as_a_range() -> None:
    text = summary(fp16_run({0, 1, 2, 3, 8, 16}))
    assert "20 optimizer steps, 6 skipped (30.0%) at steps 0-3, 8 and 16" in text
    assert "overflows at steps 0 to 16" not in text


def test_routine_fp16_backoffs_are_worded_as_what_they_are() -> None:
    text = summary(fp16_run({0, 1, 2}))
    assert "the skipped steps were fp16 overflows caught by the loss scaler, routine in dynamic loss scaling" in text
    assert "non-finite event" not in text
    assert text.endswith("no non-finite parameters found.")


def test_a_skip_at_a_scale_earlier_steps_passed_at_is_not_called_routine_and_says_it_was_not_examined() -> None:
    # Ten applied steps at 2**16, then one skip at that same scale: not the overflow after a growth of the scale.
    history = AmpHistory([StepEntry(s, 2.0**16, s == 10, None if s == 10 else 1.0, None) for s in range(20)],
                         [(10, ROUTINE, ["w"])])  # fmt: skip
    text = summary(history)
    assert "routine" not in text
    assert "step 10 had non-finite gradients at a loss scale earlier steps had passed at" in text
    assert "its cause was not examined" in text and "the monitor's autopsy replays such a step" in text


def test_a_skip_whose_replay_was_finite_is_said_not_to_be_a_stable_overflow() -> None:
    history = AmpHistory([StepEntry(s, 2.0**16, s == 10, None if s == 10 else 1.0, None) for s in range(20)],
                         [(10, ROUTINE, ["w"])], replayed={10: None})  # fmt: skip
    text = summary(history)
    assert "routine" not in text
    assert (
        "step 10 had non-finite gradients that a replay of the batch at the same loss scale did not reproduce: not a "
        "stable overflow of that batch at that scale, but something that happened once"
    ) in text


def test_a_skip_right_after_the_scale_grew_is_routine_and_each_kind_of_skip_is_said_apart() -> None:
    # Skips 0-1 bring the scale down (routine); step 6 overflows at 2**16, above every scale passed at (routine: the
    # scale had grown); step 12 fails at a scale passed before and its replay was finite.
    scales = {0: 2.0**16, 1: 2.0**15, **dict.fromkeys(range(2, 6), 2.0**14), 6: 2.0**16}
    records = [StepEntry(s, scales.get(s, 2.0**15), s in (0, 1, 6, 12), 1.0, None) for s in range(16)]
    text = summary(AmpHistory(records, [(s, ROUTINE, ["w"]) for s in (0, 1, 6, 12)], replayed={12: None}))
    assert (
        "steps 0-1 and 6 were fp16 overflows caught by the loss scaler, routine in dynamic loss scaling; step 12"
        in text
    )
    assert (
        "step 12 had non-finite gradients that a replay of the batch at the same loss scale did not reproduce" in text
    )
    grown = [StepEntry(s, 2.0**15 if s < 5 else 2.0**16, s == 5, 1.0, None) for s in range(8)]
    assert "the skipped step was an fp16 overflow caught by the loss scaler, routine" in summary(AmpHistory(grown))


def test_a_skip_the_autopsy_found_finite_at_a_lower_scale_is_routine_also_when_that_cause_was_reported_before() -> None:
    # The autopsy reports a cause once; a later skip with the same cause was examined all the same.
    records = [StepEntry(s, 2.0**10, s in (5, 9), 1.0, None) for s in range(12)]
    history = AmpHistory(records, [(5, ROUTINE, ["w"]), (9, ROUTINE, ["w"])], replayed={5: "scale", 9: "scale"})
    text = summary(history)
    assert "the skipped steps were fp16 overflows caught by the loss scaler, routine in dynamic loss scaling" in text
    assert "not examined" not in text


def test_a_run_that_ends_on_skipped_steps_is_not_called_routine() -> None:
    text = summary(fp16_run({17, 18, 19}))
    assert "the run ended on 3 skipped steps in a row" in text and "routine" not in text


def test_one_scale_is_said_once_and_counts_take_their_number() -> None:
    history = AmpHistory([StepEntry(0, 1024.0, False, 1.0, None)])
    history.nonfinite_events.append((0, "parameters", ["w"]))
    text = summary(history)
    assert "1 optimizer step, 0 skipped" in text and "loss scale 2**10 throughout" in text
    assert "1 non-finite event, the first at step 0 in parameters w" in text
    assert "2**10 to 2**10" not in text and "1 steps" not in text and "1 non-finite events" not in text


def test_a_bf16_skip_is_reported_as_non_finite_gradients_with_their_names() -> None:
    history = AmpHistory([StepEntry(0, None, False, 1.0, None), StepEntry(1, None, True, None, None),
                          StepEntry(2, None, False, 1.0, None)], [(1, ROUTINE, ["net.0.weight"])])  # fmt: skip
    text = summary(history)
    assert "skipped for non-finite gradients, the first at step 1 in net.0.weight" in text
    assert "loss scale" not in text


def test_several_optimizers_per_batch_count_every_optimizer_step() -> None:
    records = [StepEntry(step, None, False, 1.0, None) for step in range(3) for _ in range(2)]
    assert "6 optimizer steps in 3 batches, 0 skipped" in summary(AmpHistory(records))


# --------------------------------------------------------------------------------------------------- run chart
def panel_labels(history: AmpHistory) -> list[str]:
    return [axis.get_ylabel() for axis in _run_figure(history).axes]


def test_a_run_without_a_loss_scaler_draws_no_loss_scale_axis_and_says_why() -> None:
    history = AmpHistory([StepEntry(s, None, False, 1.0 + s, 100.0) for s in range(5)], memory_kind="process memory")
    figure = _run_figure(history)
    assert [axis.get_ylabel() for axis in figure.axes] == ["gradient norm", "process memory (MB)"]
    assert "no loss scaler (bf16 or fp32): no loss-scale panel" in figure.get_suptitle()
    assert "no step skipped" in figure.get_suptitle()


def test_a_gradient_norm_recorded_under_32_true_gets_its_panel() -> None:
    history = AmpHistory([StepEntry(s, None, False, 2.0, None) for s in range(4)])
    assert panel_labels(history) == ["gradient norm"]


def test_the_memory_axis_starts_at_zero_so_a_flat_line_looks_flat() -> None:
    # 0.1 MB of wiggle on 900 MB, sampled every 10 steps as the monitor does on logged steps.
    history = AmpHistory([StepEntry(s, 2.0**16, False, 1.0, 900.0 + (s % 20) / 200 if s % 10 == 9 else None)
                          for s in range(40)], memory_kind="process memory")  # fmt: skip
    memory_axis = _run_figure(history).axes[-1]
    low, high = memory_axis.get_ylim()
    assert low == 0 and high > 900
    assert memory_axis.get_xlim()[0] < 0.5  # the axis spans the run from its first step, not from the first sample


@pytest.mark.parametrize(
    ("sampled", "steps", "note"),
    [
        ({9, 19, 29, 39}, 40, "recorded on 4 of 40 steps (the steps Lightning logs): every 10th, from step 9"),
        ({9, 19, 23}, 24, "recorded on 3 of 24 steps (the steps Lightning logs)"),  # the last step logged as it stops
        (set(range(5)), 5, ""),  # every step: nothing to say
    ],
)
def test_the_memory_panel_says_on_which_steps_memory_was_recorded(sampled: set[int], steps: int, note: str) -> None:
    history = AmpHistory([StepEntry(s, None, False, 1.0, 900.0 if s in sampled else None) for s in range(steps)])
    memory_axis = _run_figure(history).axes[-1]
    assert memory_axis.get_title(loc="left") == note
    assert not any("sampled" in text.get_text() for text in memory_axis.texts)


def floor_run() -> AmpHistory:
    """fp16 at lr 1000: two steps applied (0 and 5), every other one skipped, the scale from 2**16 to its floor 2**0;
    the norm is measured on every step (inf where skipped), memory on the logged ones."""
    records, scale = [], 2.0**16
    for step in range(40):
        skipped = step not in (0, 5)
        norm = math.inf if skipped else (1.5 if step == 0 else 235.0)
        records.append(StepEntry(step, scale, skipped, norm, 860.0 if step % 10 == 9 else None))
        scale = max(scale / 2, 1.0) if skipped else scale
    return AmpHistory(records, memory_kind="process memory")


def test_a_norm_measured_every_step_is_not_called_sampled_and_its_skipped_steps_are_said_to_be_non_finite() -> None:
    norm_axis = next(axis for axis in _run_figure(floor_run()).axes if axis.get_ylabel() == "gradient norm")
    assert norm_axis.get_title(loc="left") == "not finite on the 38 skipped steps (not drawn)"
    assert norm_axis.get_title(loc="right") == "last 235 (step 5)"  # the last drawn value, not the run's last step
    line = norm_axis.get_lines()[0]
    assert line.get_marker() == "o"  # two lone points between gaps: a line alone would draw nothing
    assert [x for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True) if math.isfinite(y)] == [0, 5]


def test_the_loss_scale_ticks_label_the_lines_top_and_its_floor() -> None:
    scale_axis = _run_figure(floor_run()).axes[0]
    assert scale_axis.get_ylabel() == "loss scale"
    low, high = scale_axis.get_ylim()
    ticks = [tick for tick in scale_axis.get_yticks() if low <= tick <= high]
    labels = [scale_axis.yaxis.get_major_formatter()(tick, None) for tick in ticks]
    assert labels[0] == "2**0" and labels[-1] == "2**16"  # the floor and the start, both labelled
    assert labels == [f"2**{e}" for e in range(0, 17, 2)]
    assert low < 1.0 and high > 2.0**16  # and in view, off the frame


def test_a_two_step_chart_has_a_tick_on_each_step_and_no_empty_half_steps() -> None:
    figure = _run_figure(AmpHistory([StepEntry(0, None, False, 1.2, None), StepEntry(1, None, False, 1.1, None)]))
    axis = figure.axes[-1]
    low, high = axis.get_xlim()
    assert list(axis.get_xticks()) == [0, 1]
    assert -0.5 < low < 0 and 1 < high < 1.5


def test_skipped_steps_are_marked_in_every_panel_with_a_legend() -> None:
    figure = _run_figure(fp16_run({2, 5}))
    for axis in figure.axes:
        marked = sorted(line.get_xdata()[0] for line in axis.get_lines() if line.get_color() == "tab:red"
                        and len(line.get_xdata()) == 2 and line.get_xdata()[0] == line.get_xdata()[1])  # fmt: skip
        assert marked == [2, 5], axis.get_ylabel()
    (legend,) = figure.legends  # beside the title: with many skips no spot inside a panel is free of lines
    assert [t.get_text() for t in legend.get_texts()] == ["skipped step"]


def test_several_optimizers_in_a_batch_make_one_point_with_their_global_norm() -> None:
    records = [StepEntry(step, None, False, norm, None) for step in range(3) for norm in (3.0, 4.0)]
    figure = _run_figure(AmpHistory(records))
    (axis,) = figure.axes
    assert axis.get_ylabel() == "gradient norm (all optimizers)"
    (line,) = axis.get_lines()
    assert list(line.get_xdata()) == [0, 1, 2]
    # The global norm over both optimizers' gradients: sqrt(3**2 + 4**2), as one norm over all of them would be.
    assert list(line.get_ydata()) == [math.hypot(3.0, 4.0)] * 3


@pytest.mark.parametrize(("flushed", "said"), [(0.0, True), (float("nan"), True), (2.5, False)])
def test_a_gradient_loss_panel_without_a_bar_says_zero_in_every_layer(flushed: float, said: bool) -> None:
    import torch

    from lightning_amp_plus.diagnostics.headroom import LayerHeadroom, headroom_bits
    from lightning_amp_plus.monitor.chart import _whole_figure

    def layer(pct: float) -> LayerHeadroom:
        return LayerHeadroom(10.0, 1e-3, pct, 0.0, headroom_bits(10.0), 1.0, torch.bfloat16)

    history = AmpHistory([StepEntry(s, None, False, 1.0, None) for s in range(3)])
    history.headroom.append((2, {"body.0": layer(flushed), "head": layer(0.0)}))
    texts = [t.get_text() for t in _whole_figure(history).findobj(lambda a: hasattr(a, "get_text")) if t.get_text()]
    note = "0% in every layer:\nno gradient value flushed\nto zero or subnormal in bfloat16"
    assert (note in texts) is said


@pytest.mark.parametrize(
    "history", [AmpHistory(), fp16_run({0, 1}), AmpHistory([StepEntry(0, None, True, None, None)])]
)
def test_every_history_draws_a_png_exactly_at_the_path_given(history: AmpHistory, tmp_path: Path) -> None:
    path = tmp_path / "new folder" / "amp.png"
    assert write_chart(history, path) == path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert os.listdir(path.parent) == ["amp.png"]


def test_a_chart_never_replaces_a_file_it_takes_the_next_free_numbered_name(tmp_path: Path) -> None:
    path = tmp_path / "amp.png"
    path.write_bytes(b"a chart of another run")
    (tmp_path / "amp-1.png").write_bytes(b"and another")
    history = AmpHistory([StepEntry(s, None, False, 1.0, None) for s in range(3)])
    assert write_chart(history, path) == tmp_path / "amp-2.png"
    assert write_chart(history, path) == tmp_path / "amp-3.png"
    assert path.read_bytes() == b"a chart of another run" and (tmp_path / "amp-1.png").read_bytes() == b"and another"
    assert (tmp_path / "amp-3.png").read_bytes()[:8] == PNG_SIGNATURE


def test_a_chart_that_fails_to_draw_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_amp_plus.monitor import chart

    class Broken:
        def savefig(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("the figure could not be drawn")

    with pytest.raises(RuntimeError, match="could not be drawn"):
        chart.save_png(Broken(), tmp_path / "amp.png")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------- compare chart
def test_the_comparison_chart_labels_every_bar_and_shows_loss_and_accuracy(tmp_path: Path) -> None:
    rows = [ConfigResult("32-true", 4, 10.0, 20.0, 0.70, 0.50, 0, 1.0, 1.0),
            ConfigResult("ours-bf16-mixed", 4, 25.0, None, 0.71, 0.52, 0, 1.0, 2.5)]  # fmt: skip
    figure = _comparison_figure(rows, "title")
    titles = [axis.get_title() for axis in figure.axes]
    assert titles == ["step time vs 32-true (lower is faster)",
                      "peak memory, MB (on CPU: rise of the RSS)", "final train loss",
                      "validation accuracy"]  # fmt: skip
    labels = [[text.get_text() for text in axis.texts] for axis in figure.axes]
    assert labels == [["1.00x", "2.50x"], ["20.0", "-"], ["0.700", "0.710"], ["0.500", "0.520"]]
    path = write_comparison_chart(rows, tmp_path / "cmp.png", "title")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_a_ratio_below_one_is_labelled_past_the_reference_line_not_across_it() -> None:
    rows = [ConfigResult("32-true", 4, 10.0, 20.0, 0.70, 0.50, 0, 1.0, 1.0),
            ConfigResult("ours-bf16-mixed", 4, 9.0, 20.0, 0.70, 0.50, 0, 1.0, 0.9)]  # fmt: skip
    figure = _comparison_figure(rows, "title")
    starts = [text.xy[0] for text in figure.axes[0].texts]
    assert starts == [1.0, 1.0]  # 0.90x is written right of the 1.0x line, where it crosses nothing
    assert [text.xy[0] for text in figure.axes[1].texts] == [20.0, 20.0]  # elsewhere at the bar's end


def test_the_comparison_chart_has_a_legend_for_each_colour_its_bars_use() -> None:
    names = ["32-true", "lightning-bf16-mixed", "ours-bf16-mixed", "ours-bf16-mixed-master"]
    rows = [ConfigResult(name, 4, 10.0, 20.0, 0.7, 0.5, 0, 1.0, 1.0) for name in names]
    figure = _comparison_figure(rows, "title")
    (legend,) = figure.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels == ["fp32 (32-true)", "Lightning's built-in precision", "ours (MixedPrecisionPlugin)",
                      "ours + FP32 master weights"]  # fmt: skip
    bar_colors = [tuple(bar.get_facecolor()) for bar in figure.axes[0].patches]
    legend_colors = [tuple(patch.get_facecolor()) for patch in legend.get_patches()]
    assert legend_colors == bar_colors  # one bar of each family here, in the legend's order
    only_ours = _comparison_figure(rows[2:3], "title")
    assert [t.get_text() for t in only_ours.legends[0].get_texts()] == ["ours (MixedPrecisionPlugin)"]


# ------------------------------------------------------------------------------------------------- chart path
@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("amp.txt", "report_path='amp.txt': the chart is written as .png, so the path must end in .png, e.g. amp.png."),
        ("amp", "report_path='amp': the chart is written as .png, so the path must end in .png, e.g. amp.png."),
        ("/proc/amp.png", "report_path='/proc/amp.png': no file can be created in /proc"),
        ("", "report_path='': the path is empty. Give a file path, e.g. output.png."),
    ],
)
def test_a_chart_path_that_cannot_take_the_chart_is_refused_naming_the_argument_value_and_fix(
    path: str, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_chart_path(path)


def test_a_chart_path_check_names_the_flag_it_came_from_and_leaves_nothing_behind(tmp_path: Path) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"--report {blocker}/amp.png: {blocker} is a file, not a folder")):
        check_chart_path(blocker / "amp.png", "--report")
    assert check_chart_path(tmp_path / "new" / "amp.png") == tmp_path / "new" / "amp.png"
    assert os.listdir(tmp_path) == ["a file"]  # the folder is made when the chart is written, not when checked


def test_a_chart_path_of_the_wrong_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=re.escape("report_path=3 must be a str or a path, not int.")):
        check_chart_path(3)  # type: ignore[arg-type]


def test_a_chart_path_without_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(ImportError, match=re.escape("pip install 'lightning-amp-plus[report]'")):
        check_chart_path("amp.png")


@pytest.mark.parametrize("worst", [0.02, 12.4], ids=["low-worst", "high-worst"])
@pytest.mark.parametrize("where", [0, 8, 18], ids=["left", "middle", "right"])
def test_the_fp8_panels_labels_stay_inside_it_clear_of_the_tick_labels_and_of_each_other(
    worst: float, where: int
) -> None:
    # The worst point's layer was written 10 points below the point: a low worst point's label ran into the x axis's
    # tick labels.
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from lightning_amp_plus.monitor.fp8 import FP8Point, FP8Record

    layer = "gpt.transformer.h.0.mlp.proj"
    checks = [FP8Point(step, layer, "input", worst if step == where else 0.0) for step in range(0, 20, 2)]
    record = FP8Record(warn_pct=1.0, layers=9, checks=checks, fell_back=[(where, layer)])
    figure = _run_figure(AmpHistory([StepEntry(s, None, False, 1.0, None) for s in range(20)], fp8=record))
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    panel = figure.axes[-1]
    assert panel.get_ylabel().startswith("FP8")
    labels = [text.get_window_extent(renderer) for text in panel.texts]
    assert len(labels) == 2  # the worst point's layer and cast, the fallback's layer
    inside = panel.get_window_extent(renderer)
    ticks = [tick.get_window_extent(renderer) for tick in panel.get_xticklabels() if tick.get_text()]
    for box in labels:
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, box
        assert not any(box.overlaps(tick) for tick in ticks)
    assert not labels[0].overlaps(labels[1])
