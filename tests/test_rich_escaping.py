"""Host strings never reach rich as markup (issue 9, item 2): an error, a unit state, a release name, a lock
holder or a journal line from a host is printed as plain text. Before, `fab status` wrapped them in markup
(f"[red]{error}[/red]"), so `[/red]` in an error crashed the table (rich.errors.MarkupError) and `[green]`
in a state painted a failing unit green; the inventory table's title and the provision plan did the same."""
from __future__ import annotations

import pytest
from rich.console import Console

from deploy.report import inventory_table, problem_lines
from deploy.release import status

HOSTILE = "ConnectionError: [/red] boom [bold]x[/] [link=file:///etc/passwd]y"


def render(renderable) -> list[tuple[str, str | None]]:
    """(text, foreground colour name) of every segment rich prints for `renderable`."""
    c = Console(width=250, force_terminal=True, color_system="truecolor", record=True)
    out = []
    for seg in c.render(renderable):
        color = seg.style.color.name if seg.style and seg.style.color else None
        out.append((seg.text, color))
    return out


def text_of(segs) -> str:
    return "".join(t for t, _ in segs)


def status_segs(rows: list[dict], wide: bool = False) -> list[tuple[str, str | None]]:
    """The status table and, in the narrow view, the notes under it (release, lock, last deploy, problems)."""
    segs = render(status.status_table(rows, wide=wide))
    for line in ([] if wide else status.notes(rows)):
        segs += render(line)
    return segs


def row(**kw):
    base = {"host": "h200", "gpu": 0, "instance": "gpu0", "state": "active/running", "restarts": 0, "port": 30000,
            "health": "ok", "mode": "tree-verify", "release": "r1", "running_release": "r1", "unsafe": False,
            "lock": None, "last_deploy": None}
    return base | kw


@pytest.mark.parametrize("wide", [False, True])
def test_status_error_with_markup_does_not_crash_and_is_shown_as_is(wide):
    segs = status_segs([{"host": "ct200", "gpu": None, "error": HOSTILE}], wide)
    assert HOSTILE in text_of(segs).replace("\n", "") or all(p in text_of(segs) for p in HOSTILE.split())


@pytest.mark.parametrize("wide", [False, True])
def test_a_host_cannot_fake_a_green_state(wide):
    """A failing unit whose host reports ActiveState '[green]active' stays red, and the text shows the tag."""
    segs = status_segs([row(state="[green]active/running", health="down", release="[green]r2",
                            lock="[blink]alice[/blink]", last_deploy="deploy [/] [green]ok")], wide)
    shown = text_of(segs)
    assert "[green]active/running" in shown and "[green]r2" in shown and "[blink]alice[/blink]" in shown
    assert "deploy [/] [green]ok" in shown
    state_colours = {c for t, c in segs if "active/running" in t}
    assert state_colours == {"red"}, state_colours
    # the real thing is still green
    segs = status_segs([row()], wide)
    assert {c for t, c in segs if "active/running" in t} == {"green"}


def test_print_table_prints_hostile_rows(capsys):
    status.print_table([row(state="[/]x", health="[red]"), {"host": "h", "gpu": None, "error": "[/x]"}])
    out = capsys.readouterr().out
    assert "[/]x" in out and "[/x]" in out and "[red]" in out


class _Inv:
    fleet = "lab[/red]"
    reference_name = "ct129"


def test_inventory_table_shows_host_errors_and_values_as_text():
    facts = {"ct129": {"gathered_at": "2026-11-29T08:30:00+00:00", "address": "x",
                       "nvidia": {"driver": "[green]580[/]", "cuda": "13.0", "gpus": []},
                       "os": {"id": "debian", "version_id": "[/]12"}}}
    segs = render(inventory_table(_Inv(), facts, {"ct200": ("error", HOSTILE)}, wide=True))
    shown = text_of(segs)
    assert "lab[/red]" in shown and "[green]580[/]" in shown and "[/]12" in shown
    assert "[/red] boom" in shown
    # the narrow table and the lines under it: the same strings, as text
    shown = text_of(render(inventory_table(_Inv(), facts, {"ct200": ("error", HOSTILE)})))
    assert "lab[/red]" in shown and "[green]580[/]" in shown
    under = "\n".join(text_of(render(t)) for t in problem_lines(_Inv(), facts, {"ct200": ("error", HOSTILE)}))
    assert f"ct200: error: {HOSTILE}" in under.replace("\n", "")


def test_provision_plan_shows_names_and_messages_from_hosts_as_text():
    from deploy.provision.plan import Finding, Item, Plan, render as render_plan
    plan = Plan(host="ct200", reference="ct129",
                items=[Item(name="torch[/red]", reference="2.11.0", target="[green]2.10", status="other-version",
                            detail="[/] detail")],
                blockers=[Finding("driver", "[bold]driver [/x] too old")])
    c = Console(record=True, width=200)
    render_plan(plan, c)
    out = c.export_text()
    for s in ("torch[/red]", "[green]2.10", "[/] detail", "[bold]driver [/x] too old", "BLOCKED"):
        assert s in out, (s, out)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("value", ["[/]", "[/red]", "[bold", "\\[x]", "[link=x]y"])
def test_any_bracket_text_is_printed_verbatim(value, wide):
    segs = status_segs([row(lock=value, release=value)], wide)
    assert text_of(segs).count(value) == 2


def test_provision_summary_and_notes_show_host_errors_as_text():
    """The provision summary's error column, its events and the progress notes carry host strings (an agent's
    error, a wheel name): `[/red]` in one neither crashes the output nor restyles it."""
    from deploy.provision.overlay import HostReport, Report, _Progress, render_summary
    rep = Report([HostReport("ct200", "failed", False, error=HOSTILE)], events=[f"ct129: {HOSTILE}"])
    c = Console(record=True, width=300)
    render_summary(rep, c)
    out = c.export_text()
    assert out.count("[/red] boom [bold]x[/]") == 2, out
    c = Console(record=True, width=300)
    _Progress(False, c).note(f"ct200: sent 1 wheel(s) {HOSTILE}")
    assert HOSTILE in c.export_text()
