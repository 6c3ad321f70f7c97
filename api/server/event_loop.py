"""Which event loop `kvstore serve` runs on: uvloop when it is installed ("auto"), else asyncio's own.

Why: most of a small request's round trip through the sidecar is the loop's, not the work's.
asyncio's selector loop reads each chunk into a fresh 256 KiB bytes object and runs a Python
iteration of its own per wake-up; uvloop (libuv) reads into a reused buffer and does the rest in
C (docs/performance.md has the round-trip figures). The app is the same on both: aiohttp, the
fast path (api/server/fast_path.py) and the connection limit only use the asyncio transport and
protocol interfaces, and the tests run the fast path on both loops.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable, Coroutine, TypeVar

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A function making a new loop of kind `name` (one of EVENT_LOOPS). ValueError: "uvloop"
    asked for explicitly and not installed."""
    if name not in EVENT_LOOPS:
        raise ValueError(f"event_loop: must be one of {', '.join(EVENT_LOOPS)}; got {name!r}")
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise ValueError("event_loop: uvloop is not installed (pip install uvloop), "
                             "or use --event-loop asyncio") from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """"uvloop" or "asyncio", for the start-up line."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T], name: str) -> T:
    """`asyncio.run(main)` on a loop of kind `name`."""
    factory = loop_factory(name)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    loop = factory()  # Python 3.10: what asyncio.Runner does, by hand
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
