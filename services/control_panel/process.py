"""The control panel process: a small web server (FastAPI on uvicorn, ``app.py``) over the
services' control sockets (``panel.py``), on the service skeleton (common/service.py).

The process listens on ``host:port`` (127.0.0.1 unless told otherwise; port 0 = any free
one), writes ``<runtime_dir>/panel.json`` (its URL and pid) once listening, and removes it at
exit. uvicorn serves on a thread of its own (so it installs no signal handler of its own, and
never re-raises a signal at its end); SIGTERM/SIGINT while the server is being built end the
construction (the skeleton raises them, common/service.py) and what it made is removed; once
it runs they only ask for a stop: the loop ends the server, the clean-up runs; status 0 both
ways. The parent's death sends SIGTERM. A port
that is taken ends the process with status ``EXIT_CANNOT_LISTEN``. Requests whose Host header
is not among ``panel.allowed_hosts``, the loopback names and the listening address get 400
(a web page cannot reach a loopback panel through DNS rebinding). The panel is a client of the others' control sockets; it
has one of its own only when given a control endpoint (one in the runtime folder would be
polled as a service).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from common.config import FlashMoEConfig, allowed_hosts
from common.service import Service, ServiceFailed, run_service_process

from .app import make_app
from .panel import CONTROL_TIMEOUT_S, Panel, new_token

__all__ = ["INFO_FILE", "PanelService", "listen", "new_token", "run_panel_process"]

INFO_FILE = "panel.json"
EXIT_CANNOT_LISTEN = 2


class CannotListen(ServiceFailed):
    exit_code = EXIT_CANNOT_LISTEN


class WebServerStopped(ServiceFailed):
    what = "the web server stopped"


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=False)


class PanelService(Service):
    name = "control_panel"

    def __init__(self, config: FlashMoEConfig, runtime_dir: Path | None, host: str, port: int,
                 services: dict[str, str] | None = None,
                 control_endpoint: str | None = None) -> None:
        import uvicorn

        super().__init__(config, control_endpoint)
        self.panel = Panel(config, runtime_dir, services)
        try:
            self.listening = listen(host, port)
        except OSError as exc:
            raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror} (set "
                               f"panel.port; 0 = any free port)") from None
        actual = self.listening.getsockname()[1]
        self.url = f"http://{host}:{actual}/"
        generated = not config.panel.token
        print(f"[panel] {self.url}  token: "
              f"{self.panel.token if generated else '(panel.token, as configured)'}", flush=True)
        if host not in ("127.0.0.1", "::1", "localhost"):
            self.log.warning("listening on %s: anyone who can reach it can read the stats "
                             "(changes still need the token)", host)
        self.info = runtime_dir / INFO_FILE if runtime_dir is not None else None
        try:  # a signal here (the skeleton raises it while the service is built) leaves nothing
            if self.info is not None:
                runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.info.write_text(json.dumps({"url": self.url, "port": actual,
                                                 "pid": os.getpid()}))
                self.info.chmod(0o600)
            # uvicorn on a thread installs no signal handlers: SIGTERM reaches the skeleton,
            # whose loop ends the server.
            app = make_app(self.panel, allowed_hosts(config.panel.allowed_hosts, host))
            self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                        access_log=False, lifespan="off"))
            self.http = threading.Thread(target=self.server.run,
                                         kwargs={"sockets": [self.listening]},
                                         name="panel-http", daemon=True)
        except BaseException:
            self.listening.close()
            if self.info is not None:
                self.info.unlink(missing_ok=True)
            raise

    def banner(self) -> str:
        return f"control panel on {self.url}"

    def serve(self) -> None:
        self.panel.start()
        self.http.start()
        super().serve()

    def stats(self) -> dict:
        return {**super().stats(), **self.panel.stats_view()["panel"]}

    def on_tick(self, now: float) -> None:
        if not self.http.is_alive():
            raise WebServerStopped("uvicorn's thread ended")

    def close_resources(self) -> None:
        self.server.should_exit = True
        if self.http.is_alive():
            self.http.join(CONTROL_TIMEOUT_S * 4)
        self.panel.stop()
        self.listening.close()
        if self.info is not None:
            self.info.unlink(missing_ok=True)


def run_panel_process(config: FlashMoEConfig, runtime_dir: Path | None, host: str,
                      port: int, services: dict[str, str] | None = None,
                      control_endpoint: str | None = None) -> int:
    """Process entry: listen, announce the URL and token, serve until SIGTERM/SIGINT
    (``control_endpoint``: answer health and stats there). A signal that comes while the
    server is being built ends it there (the skeleton raises it), its files removed."""
    return run_service_process(lambda: PanelService(config, runtime_dir, host, port, services,
                                                    control_endpoint),
                               PanelService.name)
