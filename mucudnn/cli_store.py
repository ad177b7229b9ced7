"""``mucudnn store``: the benchmark store's commands (info, export, import, merge, checkpoint),
and the ``--store`` option every command that reads the store takes. Registered on the
``mucudnn`` group by :mod:`mucudnn.cli`, whose errors are one line each."""

from __future__ import annotations

import os

import click

store_option = click.option("--store", "store_path", type=click.Path(dir_okay=False),
                            help="benchmark store (default $MUCUDNN_STORE or "
                                 "~/.cache/mucudnn/benchmarks.sqlite)")


@click.group("store")
def store_group() -> None:
    """Inspect and move benchmark stores: info, export, import, merge, checkpoint.

    Each acts on --store (default $MUCUDNN_STORE or ~/.cache/mucudnn/benchmarks.sqlite).
    """


def _open_store(store_path, readonly: bool):
    from .store import open_store

    return open_store(store_path, readonly=readonly)


@store_group.command("info")
@store_option
def store_info_cmd(store_path):
    """Print the store's path, schema version and environments (GPU, cuDNN) with row counts;
    with no store of one's own yet, the measurements shipped with mucudnn (what tune reads)."""
    from .store import default_store_path, describe
    from .tuner import SHIPPED_MEASUREMENTS, SHIPPED_NAME, shipped_store

    path = default_store_path()
    if store_path is None and not os.environ.get("MUCUDNN_STORE") and not path.exists():
        click.echo(f"no store of your own yet at {path} (`mucudnn bench` on a GPU makes it)")
        with shipped_store() as shipped:
            lines = describe(shipped)
        click.echo(f"{SHIPPED_NAME}: {SHIPPED_MEASUREMENTS} (what `mucudnn tune` reads)")
        for line in lines[2:]:  # rows and environments; path and schema are the cache's
            click.echo(line)
        return
    with _open_store(store_path, readonly=True) as store:
        for line in describe(store):
            click.echo(line)


@store_group.command("export")
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("--gpu", help="only rows of this GPU")
@click.option("--cudnn", "cudnn_version", type=int, help="only rows of this cuDNN version")
@click.option("--key", help="only rows of this kernel key")
@store_option
def store_export_cmd(output, gpu, cudnn_version, key, store_path):
    """Write the store's rows as CSV to OUTPUT (gzip-compressed when it ends in .gz); the
    measurements shipped with mucudnn are not among them (they ship with every install)."""
    from .outputs import EXPORT, refuse_inputs_as_output, refuse_other_kind

    with _open_store(store_path, readonly=True) as store:
        refuse_inputs_as_output(output, [("benchmark store", store.path)])
        refuse_other_kind(output, EXPORT, option="store export")
        count = store.export_csv(output, gpu=gpu, cudnn_version=cudnn_version, key=key)
    click.echo(f"mucudnn: wrote {count} rows of store {store.path} to {output} (not the "
               "measurements shipped with mucudnn: every install has them)", err=True)


@store_group.command("import")
@click.argument("csv_path", metavar="CSV", type=click.Path(exists=True, dir_okay=False))
@store_option
def store_import_cmd(csv_path, store_path):
    """Add the rows of CSV (written by `store export`, .gz or not) to the store; a row already
    there (same GPU, cuDNN, key, batch, algorithm, math) is replaced."""
    with _open_store(store_path, readonly=False) as store:
        count = store.import_csv(csv_path)
        click.echo(f"mucudnn: imported {count} rows into {store.path}", err=True)


@store_group.command("merge")
@click.argument("other", type=click.Path(exists=True, dir_okay=False))
@store_option
def store_merge_cmd(other, store_path):
    """Copy every row of the store OTHER into the store; OTHER's rows replace the same rows."""
    from .outputs import same_file

    with _open_store(store_path, readonly=False) as store:
        if same_file(other, store.path):
            raise click.UsageError(f"{other} is the store itself; name another store")
        with _open_store(other, readonly=True) as source:
            count = store.merge_from(source)
        click.echo(f"mucudnn: merged {count} rows from {other} into {store.path}", err=True)


@store_group.command("checkpoint")
@store_option
def store_checkpoint_cmd(store_path):
    """Fold the store's WAL journal into its file, so copying the file alone copies every row."""
    with _open_store(store_path, readonly=False) as store:
        store.checkpoint()
        click.echo(f"mucudnn: checkpointed {store.path}", err=True)
