"""jlora.plot: the dependency-free SVG bar chart behind docs/benchmarks.svg."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from jlora.plot import bar_chart_svg

NS = "{http://www.w3.org/2000/svg}"


def test_bar_chart_svg():
    labels = ["jlora, 4 adapters mixed", "a <&> b", "base"]
    svg = bar_chart_svg("Throughput", labels, [120.0, 60.0, 30.0], "tok/s", reference=180.0,
                        reference_label="3x target")
    root = ET.fromstring(svg)  # well-formed XML, so the label with <&> was escaped
    assert "a &lt;&amp;&gt; b" in svg
    bars = [r for r in root.iter(f"{NS}rect") if r.get("class") == "bar"]
    assert len(bars) == len(labels)
    widths = [float(b.get("width")) for b in bars]
    assert widths[0] / widths[1] == pytest.approx(2.0, rel=1e-2)
    assert widths[0] / widths[2] == pytest.approx(4.0, rel=1e-2)
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "Throughput" in texts
    assert all(label in texts for label in labels)
    assert {"120.0 tok/s", "60.0 tok/s", "30.0 tok/s"} <= set(texts)
    assert "3x target = 180.0 tok/s" in texts
    (line,) = root.iter(f"{NS}line")  # the reference line, on the same scale as the bars
    x0 = float(bars[0].get("x"))
    assert (float(line.get("x1")) - x0) / widths[0] == pytest.approx(1.5, rel=1e-2)


def test_bar_chart_svg_without_reference():
    root = ET.fromstring(bar_chart_svg("T", ["a"], [1.0], "x"))
    assert not list(root.iter(f"{NS}line"))
    with pytest.raises(ValueError):
        bar_chart_svg("T", ["a", "b"], [1.0], "x")
