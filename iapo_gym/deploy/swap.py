"""Swapping ``serve``'s policy without a dropped request: SIGHUP, or ``POST /admin/policy`` with the admin key.

Either one re-reads the policy file ``serve`` was started with (its path, so a file replaced there, or a
symbolic link pointed elsewhere, is what is read) and checks it as start-up does, in one place: the file
(``load_policy``: its schema, consistency and checksum), the policy against the upstream spec
(``Router.with_policy`` builds the new ``Router`` with the same checks as any ``Router``) and against the
serving budget (``ServeApp.check_router``). A swap also refuses a policy of another task, aggregator or
objectives than the one served: the outcome log, the feedback a caller sends and the budget's meaning hold
across a swap. The reading and checking run off the event loop; the swap itself
(``ServeApp.use_router``) is one step on it, with no await: a request takes the router once, as it
starts, so a request in flight finishes on the policy it started with, a new one gets the new policy, and
none is refused or waits for the swap. The new router serves through the same open upstream connections (and
spending cap); a reward scorer the new policy does not share is closed one deadline after the swap, when
no request can still use it.

A bad file is refused, the old policy keeps serving: after SIGHUP the reason goes to the server's log,
``POST /admin/policy`` answers 422 ``policy_refused`` naming it. A file whose policy is the one served (the
same ``sha256``) is ``unchanged``: nothing is swapped.

The admin route exists only with ``serve --admin-key-env VAR`` (else 404), and answers 403 without that
key (the inbound key does not open it; the two keys must differ). With ``--workers K`` the supervisor
(``run_workers``) passes SIGHUP on to each worker, which swaps in its own process, instead of uvicorn's
default of restarting the workers; an admin request swaps the worker that answers it and then sends SIGHUP
to the supervisor, so every sibling re-reads the same file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import json
import os
import signal
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from iapo_gym.deploy.app import JSON, read_body
from iapo_gym.deploy.params import RequestError
from iapo_gym.policyfile import PolicyFileError, load_policy

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from iapo_gym.deploy.errors import Masker
    from iapo_gym.deploy.limits import ServeLimits
    from iapo_gym.deploy.router import Router

__all__ = ["ADMIN_PATH", "PolicySwap", "SwapRefused", "ignore_hangup", "install", "run_workers"]

#: The admin route that swaps the policy (with ``--admin-key-env``).
ADMIN_PATH = "/admin/policy"
#: The largest body ``POST /admin/policy`` reads (it takes none, or ``{}``).
ADMIN_BODY_LIMIT = 1024
#: Seconds past the deadline after which a replaced router's own scorer is closed.
RETIRE_MARGIN = 1.0
#: What must not change at a swap, and why: the log's readers, the feedback's shape and the budget depend on it.
KEPT = ("task", "aggregator", "objectives")


class Swappable(Protocol):
    """What a swap uses of ``iapo_gym.deploy.server.ServeApp`` (named here: the server imports this module)."""

    router: Router
    limits: ServeLimits
    log: TextIO
    mask: Masker
    asgi: Starlette
    swap: PolicySwap | None

    def check_router(self, router: Router) -> None: ...

    def use_router(self, router: Router) -> None: ...


class SwapRefused(ValueError):
    """A policy file that cannot be swapped in; the message names the problem."""


class PolicySwap:
    """The policy swap of one ``serve`` process (module docstring)."""

    def __init__(self, app: Swappable, path: str | os.PathLike[str], *, admin_key: str | None = None,
                 workers: int = 1) -> None:
        """``path``: the policy file re-read at each swap; ``admin_key``: the key ``POST /admin/policy`` needs
        (None: no admin route); ``workers`` > 1: this process is a worker of ``run_workers``' supervisor."""
        self.app, self.path = app, Path(path).absolute()
        self.expected = admin_key.encode() if admin_key else None
        self.siblings = workers > 1
        self.swaps = 0
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._retiring: list[tuple[Router, Router, asyncio.TimerHandle]] = []
        self._listening = False

    def _log(self, message: str) -> None:
        print(f"iapo-gym serve: {self.app.mask(message)}", file=self.app.log, flush=True)

    # ---- triggers ------------------------------------------------------------------------------------
    def listen(self) -> None:
        """Swap on SIGHUP (from the app's lifespan, on the serving loop; only in the main thread, where signals are
        delivered)."""
        if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
            return
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_signal)
        self._listening = True

    def _on_signal(self) -> None:
        task = asyncio.get_running_loop().create_task(self._signalled())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _signalled(self) -> None:
        with contextlib.suppress(SwapRefused):  # logged by reload; the old policy keeps serving
            await self.reload("SIGHUP")

    async def admin(self, request: Request) -> Response:
        """``POST /admin/policy``: re-read the policy file and swap (200 ``swapped`` or ``unchanged``), or 422
        ``policy_refused`` naming the problem; 403 without the admin key."""
        if not self._admin(request.headers):
            raise RequestError(403, "this route needs the admin key: send 'Authorization: Bearer <key>' with the key "
                                    "in the variable serve's --admin-key-env names", "invalid_admin_key")
        raw = await read_body(request, ADMIN_BODY_LIMIT)
        if raw.strip() not in (b"", b"{}"):
            raise RequestError(400, f"POST {ADMIN_PATH} takes no body (or {{}}): it re-reads the policy file serve was "
                                    "started with; replace that file first", "invalid_request")
        try:
            result = await self.reload(f"POST {ADMIN_PATH}")
        except SwapRefused as exc:
            raise RequestError(422, str(exc), "policy_refused") from None
        if self.siblings:  # the supervisor passes SIGHUP on to every worker: the siblings read the same file
            os.kill(os.getppid(), signal.SIGHUP)
            result["workers"] = "signalled"
        return Response(json.dumps(result).encode(), media_type=JSON)

    def _admin(self, headers: Mapping[str, str]) -> bool:
        if self.expected is None:
            return False
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.expected)

    # ---- the swap ------------------------------------------------------------------------------------
    async def reload(self, trigger: str) -> dict[str, Any]:
        """Read, check and swap in the policy file (one swap at a time); what is served after, as the admin route
        answers it. Raises ``SwapRefused`` (logged) when the file cannot be served: the old policy keeps serving."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            old = self.app.router
            try:
                new, notes = await asyncio.to_thread(self._build, old)
            except (ValueError, OSError) as exc:  # PolicyFileError, SpecError and the budget's check are ValueErrors
                self._log(f"policy_refused ({trigger}): {exc}; still serving policy {old.policy.sha256[:12]}")
                raise SwapRefused(str(exc)) from None
            for note in notes:
                self._log(f"warning ({trigger}): {note}")
            if new is None:
                self._log(f"policy unchanged ({trigger}): {self.path} holds the policy served "
                          f"({old.policy.sha256[:12]})")
                return self._report("unchanged", old, old)
            self.app.use_router(new)  # one step on the loop: a request in flight keeps the router it took
            self.swaps += 1
            self._retire_later(old, new)
            self._log(f"policy swapped ({trigger}): {old.policy.sha256[:12]} -> {new.policy.sha256[:12]} from "
                      f"{self.path}, {len(new.contexts)} contexts")
            return self._report("swapped", new, old)

    def _build(self, old: Router) -> tuple[Router | None, list[str]]:
        """The checked router of the file's policy (None when it is the one served) and the warnings of its checks;
        on a worker thread (the file is read and checked off the event loop)."""
        policy = load_policy(self.path)
        if policy.sha256 == old.policy.sha256:
            return None, []
        for name in KEPT:
            was, now = getattr(old.policy, name), getattr(policy, name)
            if was != now:
                raise PolicyFileError(f"{self.path}: {name} {_show(now)} differs from the served policy's "
                                      f"{_show(was)}: a swap keeps the {', '.join(KEPT)} (restart serve to change "
                                      "them)")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            new = old.with_policy(policy)  # the spec's checks, as at start-up
        self.app.check_router(new)  # the serving budget's, as at start-up
        return new, [str(w.message) for w in caught]

    def _report(self, status: str, served: Router, previous: Router) -> dict[str, Any]:
        return {"status": status, "policy": {
            "path": str(self.path), "sha256": served.policy.sha256,
            "contexts": [{"name": c.name, "prompt": c.prompt, "n": c.n} for c in served.contexts]},
            "previous": previous.policy.sha256, "pid": os.getpid()}

    def _retire_later(self, old: Router, new: Router) -> None:
        """Close ``old``'s own scorer (``Router.retire``) once no request can still use it: one deadline on."""
        loop = asyncio.get_running_loop()

        def retire() -> None:
            self._retiring[:] = [r for r in self._retiring if r[0] is not old]
            task = loop.create_task(old.retire(new))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        handle = loop.call_later(self.app.limits.deadline + RETIRE_MARGIN, retire)
        self._retiring.append((old, new, handle))

    async def close(self) -> None:
        """Stop listening; close the replaced routers' own scorers now (the server is stopping)."""
        if self._listening:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            ignore_hangup()  # a SIGHUP while the server stops does not kill it
            self._listening = False
        for task in list(self._tasks):
            task.cancel()
        retiring, self._retiring = self._retiring, []
        for old, new, handle in retiring:
            handle.cancel()
            await old.retire(new)


def ignore_hangup() -> None:
    """Ignore SIGHUP in this process (until ``PolicySwap.listen``): its default action would end the process."""
    if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def install(app: Swappable, path: str | os.PathLike[str], *, admin_key: str | None = None,
            workers: int = 1) -> PolicySwap:
    """Give ``app`` its policy swap: SIGHUP re-reads ``path`` once the app has started, and with ``admin_key`` the
    route ``POST /admin/policy`` does too (without it the route does not exist: 404)."""
    swap = PolicySwap(app, path, admin_key=admin_key, workers=workers)
    app.swap = swap
    if admin_key:
        app.asgi.router.routes.append(Route(ADMIN_PATH, swap.admin, methods=["POST"]))
    return swap


def run_workers(app: str, options: dict[str, Any]) -> None:
    """uvicorn's supervisor of ``options['workers']`` processes of the factory ``app`` on one socket, except that
    SIGHUP is passed on to each worker (which swaps its policy in its own process, ``PolicySwap``) instead of
    restarting the workers (uvicorn's default, which closes the connections the old workers hold)."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    class Supervisor(Multiprocess):
        def handle_hup(self) -> None:
            for process in self.processes:
                pid = getattr(process, "pid", None)
                if pid:
                    with contextlib.suppress(ProcessLookupError):  # a worker that just died is restarted anyway
                        os.kill(pid, signal.SIGHUP)

    config = uvicorn.Config(app, factory=True, **options)
    server = uvicorn.Server(config)
    sock = config.bind_socket()
    # an older uvicorn's supervisor also takes the worker's target
    target = {"target": server.run} if "target" in inspect.signature(Multiprocess.__init__).parameters else {}
    try:
        Supervisor(config, sockets=[sock], **target).run()
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
