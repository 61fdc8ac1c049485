"""progress_bar: tqdm on a terminal; off one, one plain line per finished item and no cursor codes."""
import io

from tqdm import tqdm

from sdopt.tools.progress import LogLines, progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_each_finished_item_is_one_plain_line():
    log = io.StringIO()
    bar = progress_bar(["512", "1024", "2048"], desc="vae decode", unit="run", file=log)
    assert isinstance(bar, LogLines)
    for size in bar:
        bar.set_postfix_str(f"{size} px")
    lines = log.getvalue().splitlines()
    assert [line.split(", ")[0] for line in lines] == ["vae decode: 1/3 runs", "vae decode: 2/3 runs", "vae decode: 3/3 runs"]
    assert lines[0].endswith(" s (512 px)") and lines[2].endswith(" s (2048 px)"), "the postfix of the item that finished"
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()
    assert log.getvalue().endswith(" px)\n"), "closing adds nothing"


def test_manual_updates_without_a_total_and_a_disabled_bar():
    log = io.StringIO()
    with progress_bar(desc="checks", unit="check", file=log) as bar:
        bar.update()
        bar.set_postfix_str("sdpa")  # no progress: no line
        bar.update(2)
    assert [line.split(", ")[0] for line in log.getvalue().splitlines()] == ["checks: 1/? checks", "checks: 3/? checks"]
    with progress_bar(total=1, desc="suite", unit="phase", file=log) as bar:
        bar.write("phase 1 starts", file=log)
        bar.update()
    assert log.getvalue().endswith("phase 1 starts\nsuite: 1/1 phases, " + log.getvalue().rsplit(", ", 1)[1])
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()
    quiet = io.StringIO()
    with progress_bar(total=3, file=quiet, disable=True) as bar:
        bar.update()
    assert quiet.getvalue() == ""


def test_on_a_terminal_it_is_tqdms_bar():
    bar = progress_bar(total=2, file=Terminal())
    assert type(bar) is tqdm
    bar.close()


def test_a_long_count_writes_a_line_per_twentieth_and_the_last():
    log = io.StringIO()
    for _ in progress_bar(range(730), desc="checkpoint", unit="tensor", file=log):
        pass
    counts = [int(line.split(": ")[1].split("/")[0]) for line in log.getvalue().splitlines()]
    assert len(counts) == 20 and counts[-1] == 730 and counts == sorted(counts)
    assert all(later - earlier <= 730 // 20 + 1 for earlier, later in zip([0, *counts], counts))
    short = io.StringIO()
    for _ in progress_bar(range(40), desc="steps", file=short):
        pass
    assert len(short.getvalue().splitlines()) == 40, "up to 40 items, every one"
