"""``kvq serve``'s server loop, in place of ``mlx_lm.server.run``: kvq's response generator and handler
(:mod:`kvq.cli.serve_handler`), a warning when the port is open beyond this machine without ``--api-key``, and a
drain on SIGTERM or Ctrl-C: the port closes, the requests in flight finish (up to ``--drain-seconds``), then the
generation thread stops.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from http.server import ThreadingHTTPServer

from mlx_lm import server

from .serve_api import ServePolicy
from .serve_handler import KVQHandler, KVQResponseGenerator, handler_class


#: Connections the kernel holds for ``accept`` (socketserver's default is 5: a burst of clients overflows it)
LISTEN_BACKLOG = 128


def listens_beyond_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` can be reached from other machines (any address not loopback)."""
    try:
        infos = socket.getaddrinfo(host or None, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return True
    return any(not ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def run(host: str, port: int, model_provider, *, policy: ServePolicy, drain_seconds: float) -> None:
    """``mlx_lm.server.run`` with kvq's response generator and handler: rank 0 serves HTTP until SIGTERM or
    Ctrl-C, then drains; other ranks (under ``mlx.launch``) run the generation loop."""
    import mlx.core as mx

    cli_args = model_provider.cli_args
    if policy.max_tokens_cap is not None:
        cli_args.max_tokens = min(cli_args.max_tokens, policy.max_tokens_cap)
    generator = KVQResponseGenerator(model_provider, server.LRUPromptCache(cli_args.prompt_cache_size),
                                     policy.context_length)
    if mx.distributed.init().rank() != 0:
        return generator.join()
    if policy.api_key is None and listens_beyond_loopback(host):
        logging.warning(f"kvq serve: listening on {host}, beyond this machine, without --api-key: anyone who can "
                        "reach the port can use the model")
    serve_http(host, port, generator, handler_class(policy), drain_seconds)
    exit_now()


def serve_http(host: str, port: int, generator, handler: type[KVQHandler], drain_seconds: float) -> None:
    """Serve HTTP on ``host:port`` until SIGTERM or Ctrl-C; then close the port, wait up to ``drain_seconds`` for the
    requests in flight and stop ``generator`` (a second SIGTERM kills at once).

    :raises ValueError: the port cannot be bound (in use, or a host that is not this machine's).
    """
    fingerprint = server.get_system_fingerprint()
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        server_class = type("KVQHTTPServer", (ThreadingHTTPServer,),
                            {"address_family": family, "request_queue_size": LISTEN_BACKLOG})
        httpd = server_class(address, lambda *a, **kw: handler(generator, *a, system_fingerprint=fingerprint, **kw))
    except OSError as exc:  # the generation thread is running: without it stopped the process would never exit
        stop_generation(generator)
        raise ValueError(f"cannot listen on {host}:{port}: {exc}") from None
    logging.info(f"Starting httpd at {host} on port {port}...")
    previous = install_sigterm()
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        httpd.server_close()
    logging.info(f"kvq serve: stopping; {handler.in_flight.count} requests in flight get {drain_seconds} s")
    if not handler.in_flight.wait_idle(drain_seconds):
        logging.warning(f"kvq serve: {handler.in_flight.count} requests still in flight after {drain_seconds} s")
    stop_generation(generator)


def install_sigterm():
    """Make SIGTERM end ``serve_forever`` as Ctrl-C does (main thread only); the handler it replaced, or None."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, interrupt)


def stop_generation(generator, seconds: float = 10) -> None:
    """Stop the generation thread; if it has not stopped after ``seconds`` (a rank under ``mlx.launch`` waiting for
    a peer that is gone), leave the process at once, since that thread would keep it alive."""
    stopper = threading.Thread(target=generator.stop_and_join, daemon=True)
    stopper.start()
    stopper.join(seconds)
    if stopper.is_alive():
        logging.warning(f"kvq serve: the generation thread did not stop within {seconds} s; exiting without it")
        exit_now()


def exit_now() -> None:
    """End the process with status 0 once the server has stopped, skipping the interpreter's teardown: after a
    generation thread has run, MLX 0.32 aborts in its exit-time destructors ("terminate called without an active
    exception", status -6; ``mlx_lm.server`` 0.32.2 does the same after Ctrl-C)."""
    logging.info("kvq serve: stopped")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
