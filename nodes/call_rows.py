"""A call's rows: what ComfyUI's transformer_options say about the batch a model call runs, so that a split
call (Low Memory's sequential CFG) keeps the step caches' bookkeeping true: ``label_batch_rows`` labels each
part, ``call_key`` is what a step cache files a call under."""
from __future__ import annotations

# Set on the transformer_options of one part of a batch split into sequential calls (Low Memory's
# sequential cfg): the part's rows of the whole batch. Parts have equal shapes, so the step caches
# need it to tell one part's call from another's.
BATCH_ROWS = "sdopt_batch_rows"


def call_key(transformer_options: dict) -> tuple:
    """What a step cache files a model call under: the conditionings it batches (ComfyUI's
    ``cond_or_uncond``) and, for one part of a split batch, its rows."""
    return tuple(transformer_options.get("cond_or_uncond") or ()), transformer_options.get(BATCH_ROWS)


def label_batch_rows(rows: slice, batch: int, args: tuple, kwargs: dict) -> None:
    """Make each transformer_options among a part's arguments describe the part's own rows: ComfyUI lists
    one ``cond_or_uncond`` and ``uuids`` entry per conditioning, each covering ``batch / entries`` rows
    (caches such as EasyCache split the batch by them), and the rows themselves (``BATCH_ROWS``)."""
    for options in (*args, *kwargs.values()):
        if not (isinstance(options, dict) and "cond_or_uncond" in options):
            continue
        entries = len(options["cond_or_uncond"] or ())
        if entries and batch % entries == 0:
            per_entry = batch // entries
            covered = slice(rows.start // per_entry, (rows.stop - 1) // per_entry + 1)
            for name in ("cond_or_uncond", "uuids"):
                if isinstance(options.get(name), list) and len(options[name]) == entries:
                    options[name] = options[name][covered]
        options[BATCH_ROWS] = (rows.start, rows.stop)
