"""The "Attention" tab: a TensorBoard plugin that serves the explorer's files and the page that shows them.

Registered through the ``tensorboard_plugins`` entry point, so ``tensorboard --logdir ...`` finds it once
attn_callbacks is installed. Routes (under ``/data/plugin/attention_explorer``), each answering JSON (errors too:
``{"error": message}`` with a 4xx/5xx status, never a traceback page):

- ``/index.js``: the tab's ES module;
- ``/runs``: every run with explorer data, its views and their epochs;
- ``/labels?run&view&epoch&step``: one epoch's tokens (ids, labels, query counts);
- ``/token?run&view&epoch&step&head&token[&limit][&side]``: a token's "attends to" and "attended by" lists;
- ``/heatmap?run&view&epoch&step&head&size[&around][&side]``: ``P``, lift and counts over the top tokens or a
  token's neighbourhood;
- ``/history?run&view&epoch&step&head&token[&keys]``: the token's top keys' ``P`` across epochs and its row's drift.

``head`` is ``mean`` or a head index; ``side`` (``query`` or ``key``) says which vocabulary a cross-attention
module's token id is of (without it, the id is looked up on both axes, as in self-attention). A run is accepted only
when the data provider lists it, a view and an epoch only when that run's folder lists them: no path is built from
request input. An epoch route whose URL carries the listed ``v`` (the epoch's version) may be cached by the browser:
that URL's answer never changes.

Imports the standard library, numpy, werkzeug and tensorboard only (not torch): TensorBoard imports every plugin at
start, and a slow or failing import would take it down.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import time
from collections.abc import Callable
from typing import Any

from tensorboard import errors as tb_errors
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from attn_callbacks.base.config import short_repr
from attn_callbacks.explorer import queries
from attn_callbacks.explorer.data import PLUGIN_NAME, ExplorerDataError, ExplorerEpoch, list_views, read_epoch

__all__ = ["ExplorerPlugin"]

_CACHE_SECONDS = 24 * 3600
_DECIMAL = re.compile(r"-?[0-9]+")  # int() would also take '١' and '0_1'
_ACTIVE_RECHECK = 30.0  # seconds between two walks of the logdir while no run has data


_Listed = tuple[int, int, int]  # (epoch, step, version)


class _RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ExplorerPlugin(base_plugin.TBPlugin):
    """TensorBoard's "Attention" tab (see the module docstring for its routes)."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._logdir = context.logdir or ""
        self._data_provider = context.data_provider
        self._active: bool | None = None
        self._checked = 0.0

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Attention", disable_reload=False)

    def get_plugin_apps(self) -> dict[str, Callable]:
        return {
            "/index.js": self._serve_script,
            "/runs": self._route(self._runs),
            "/labels": self._route(self._labels),
            "/token": self._route(self._token),
            "/heatmap": self._route(self._heatmap),
            "/history": self._route(self._history),
        }

    def is_active(self) -> bool:
        """True once some folder below the logdir holds explorer data (a walk of the logdir, repeated at most every
        30 s while none does; no walk with ``--logdir_spec``, which gives plugins no logdir)."""
        if self._active or (self._active is False and time.monotonic() - self._checked < _ACTIVE_RECHECK):
            return bool(self._active)
        self._checked = time.monotonic()
        self._active = False
        if self._logdir and os.path.isdir(self._logdir):
            for folder, subfolders, _ in os.walk(self._logdir):
                if os.path.basename(folder) == "plugins" and PLUGIN_NAME in subfolders:
                    self._active = True
                    break
        return self._active

    # ------------------------------------------------------------------------------------------------ plumbing
    @wrappers.Request.application
    def _serve_script(self, request: wrappers.Request) -> wrappers.Response:
        script = importlib.resources.files("attn_callbacks.explorer").joinpath("static/index.js").read_bytes()
        return http_util.Respond(request, script, "text/javascript")

    def _route(self, handler: Callable[[wrappers.Request], tuple[Any, bool]]) -> Callable:
        @wrappers.Request.application
        def app(request: wrappers.Request) -> wrappers.Response:
            try:
                body, cacheable = handler(request)
            except _RequestError as error:
                return http_util.Respond(request, {"error": str(error)}, "application/json", code=error.status)
            except ExplorerDataError as error:
                message = f"this epoch's explorer data cannot be read: {error}"
                return http_util.Respond(request, {"error": message}, "application/json", code=500)
            except tb_errors.PublicError as error:
                return http_util.Respond(request, {"error": str(error)}, "application/json", code=error.http_code)
            except Exception as error:  # the tab shows the message, never a traceback page
                message = f"the Attention plugin failed: {type(error).__name__}: {error}"
                return http_util.Respond(request, {"error": message}, "application/json", code=500)
            return http_util.Respond(request, body, "application/json", expires=_CACHE_SECONDS if cacheable else 0)

        return app

    def _run_dirs(self, request: wrappers.Request) -> dict[str, str]:
        """Run name -> its folder, for every run the data provider lists."""
        if self._data_provider is None or not self._logdir:
            return {}
        ctx = plugin_util.context(request.environ)
        runs = self._data_provider.list_runs(ctx, experiment_id=plugin_util.experiment_id(request.environ))
        return {run.run_name: os.path.join(self._logdir, run.run_name) for run in runs}

    def _epoch(self, request: wrappers.Request) -> tuple[str, str, list[_Listed], int, ExplorerEpoch, bool]:
        """The run folder, the view, its epochs, the chosen epoch's index in them, that epoch read, and whether the
        URL names its current version."""
        args = request.args
        run = args.get("run")
        if not run:
            raise _RequestError(400, "missing parameter 'run'")
        folders = self._run_dirs(request)
        if run not in folders:
            raise _RequestError(404, f"no run named {short_repr(run)} in this TensorBoard")
        views = list_views(folders[run])
        view = args.get("view")
        if not view:
            raise _RequestError(400, "missing parameter 'view'")
        if view not in views:
            raise _RequestError(404, f"run {short_repr(run)} has no explorer data for view {short_repr(view)}")
        epochs = views[view]
        epoch, step = _integer(args, "epoch"), _integer(args, "step", required=False)
        matches = [i for i, (e, s, _) in enumerate(epochs) if e == epoch and (step is None or s == step)]
        if not matches:
            raise _RequestError(
                404, f"view {short_repr(view)} of run {short_repr(run)} has no epoch {epoch} (step {step})"
            )
        index = matches[-1]
        e, s, version = epochs[index]
        return folders[run], view, epochs, index, read_epoch(folders[run], view, e, s), args.get("v") == str(version)

    # -------------------------------------------------------------------------------------------------- routes
    def _runs(self, request: wrappers.Request) -> tuple[Any, bool]:
        runs = []
        for run, folder in sorted(self._run_dirs(request).items()):
            views = []
            for view, epochs in list_views(folder).items():
                try:
                    last = read_epoch(folder, view, *epochs[-1][:2]).meta
                except ExplorerDataError as error:
                    views.append({"view": view, "error": str(error), "epochs": []})
                    continue
                views.append(
                    {
                        "view": view,
                        "module": last["module"],
                        "streams": last["streams"],
                        "heads": last["heads"],
                        "epochs": [{"epoch": e, "step": s, "v": str(v)} for e, s, v in epochs],
                    }
                )
            if views:
                runs.append({"run": run, "views": views})
        return {"runs": runs}, False

    def _labels(self, request: wrappers.Request) -> tuple[Any, bool]:
        *_, epoch, cacheable = self._epoch(request)
        meta = epoch.meta
        keys = ("view", "module", "streams", "epoch", "step", "heads", "shape")
        labels = ("query_ids", "query_labels", "query_count", "key_ids", "key_labels")
        return {**{key: meta[key] for key in keys}, **{key: meta[key] for key in labels}}, cacheable

    def _token(self, request: wrappers.Request) -> tuple[Any, bool]:
        *_, epoch, cacheable = self._epoch(request)
        head = _head(request.args, epoch.heads)
        limit = _integer(request.args, "limit", required=False, least=1)
        side = _side(request.args)
        return queries.token_view(epoch, head, _integer(request.args, "token"), limit, side), cacheable

    def _heatmap(self, request: wrappers.Request) -> tuple[Any, bool]:
        *_, epoch, cacheable = self._epoch(request)
        head = _head(request.args, epoch.heads)
        size = _integer(request.args, "size", required=False, least=1, most=256) or 24
        around = _integer(request.args, "around", required=False)
        return queries.heatmap(epoch, head, size, around, _side(request.args)), cacheable

    def _history(self, request: wrappers.Request) -> tuple[Any, bool]:
        folder, view, epochs, index, epoch, _ = self._epoch(request)
        head = _head(request.args, epoch.heads)
        read = [epoch if i == index else _readable(folder, view, e, s) for i, (e, s, _) in enumerate(epochs)]
        # Epochs that cannot be read, or lack the head, are left out of the lines (the others still answer).
        usable = [i for i, item in enumerate(read) if item is not None and (head is None or head < item.heads)]
        keys = _integer(request.args, "keys", required=False, least=1, most=100)
        result = queries.history(
            [read[i] for i in usable], head, _integer(request.args, "token"), usable.index(index), keys or 5
        )
        return result, False  # a later epoch changes it


def _readable(folder: str, view: str, epoch: int, step: int) -> ExplorerEpoch | None:
    try:
        return read_epoch(folder, view, epoch, step)
    except ExplorerDataError:
        return None


def _integer(
    args: Any, name: str, required: bool = True, least: int | None = None, most: int | None = None
) -> int | None:
    """Parameter ``name`` as a plain decimal integer (ASCII digits only), within ``[least, most]`` where given."""
    value = args.get(name)
    if value is None or value == "":
        if required:
            raise _RequestError(400, f"missing parameter {name!r}")
        return None
    if not _DECIMAL.fullmatch(value):
        raise _RequestError(400, f"parameter {name!r} must be an integer, got {short_repr(value)}")
    number = int(value)
    if (least is not None and number < least) or (most is not None and number > most):
        bounds = f"at least {least}" if most is None else f"between {least} and {most}"
        raise _RequestError(400, f"parameter {name!r} must be {bounds}, got {number}")
    return number


def _side(args: Any) -> str | None:
    """``query`` or ``key`` (the axis a cross-attention token id belongs to), or None for both."""
    side = args.get("side") or None
    if side not in (None, "query", "key"):
        raise _RequestError(400, f"side must be 'query' or 'key', got {short_repr(side)}")
    return side


def _head(args: Any, heads: int) -> int | None:
    """``mean`` (or nothing) -> None; a head index, checked against the epoch's heads."""
    value = args.get("head", "mean")
    if value == "mean":
        return None
    head = _integer(args, "head")
    if not 0 <= head < heads:
        kept = f"heads 0..{heads - 1} and 'mean'" if heads else "only 'mean' (per_head=False)"
        raise _RequestError(400, f"head {head} is not stored for this epoch: it has {kept}")
    return head
