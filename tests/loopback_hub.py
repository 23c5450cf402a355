"""A minimal Hugging Face Hub on loopback, for testing uploads and downloads with the real ``huggingface_hub`` client.

It implements only what ``huggingface_hub`` (2.x; the same endpoints as 1.x) sends for ``create_repo``,
``create_commit`` / ``upload_file`` (``push_to_hub``), ``model_info`` / ``repo_info``, ``hf_hub_download``
(``from_pretrained``, ``ModelCard.load``) and README validation, for model repositories:

* ``POST /api/repos/create``: ``{"name", "organization"}`` -> ``{"url"}``; 409 when the repository exists.
* ``GET /api/models/{repo}[/revision/{rev}]``: ``{"id", "sha", "siblings": [{"rfilename", "size"}], ...}``.
* ``POST /api/validate-yaml``: parses the README's YAML header (400 with ``errors`` when it does not parse).
* ``POST /api/models/{repo}/preupload/{rev}``: answers ``uploadMode: "regular"`` for every file, so the client
  sends contents inline (base64) in the commit. The client takes the upload path from this answer alone
  (``_commit_api._fetch_upload_modes``); the real Hub says ``"lfs"`` for weights, which the client then uploads
  through Xet when ``hf_xet`` is installed, or the LFS batch API otherwise: neither is implemented here. ``oid`` is
  the git blob hash of the file already there, which lets the client skip unchanged files as against the Hub.
  Downloads use Xet only when a response carries ``X-Xet-Hash``, which this server never sends.
* ``POST /api/models/{repo}/commit/{rev}``: the ndjson commit (``header``, ``file``, ``deletedFile``,
  ``deletedFolder``); ``?create_pr=1`` opens ``refs/pr/N``.
* ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: the file, with the headers ``hf_hub_download`` reads: ``ETag``
  (the git blob hash), ``X-Repo-Commit``, ``Content-Length``; 404s carry ``X-Error-Code`` (``RepoNotFound``,
  ``RevisionNotFound``, ``EntryNotFound``) as the Hub's do, which the client maps onto its exceptions.

Anything else gets a 404 and is recorded in ``LoopbackHub.unhandled``. Every request is recorded in
``LoopbackHub.requests`` as ``(method, path)``. State lives in memory: ``LoopbackHub.files(repo_id, revision)``.
Commits are content-addressed (the same files and message give the same commit hash), like git.

Pointing the client at it: ``huggingface_hub`` reads ``HF_ENDPOINT`` once, at import, into
``huggingface_hub.constants.ENDPOINT`` (and the download-URL template built from it), and transformers keeps one
``HfApi`` whose endpoint was fixed when it was created. :meth:`LoopbackHub.patch_endpoint` patches those three (and
the download cache) and checks that they took, so a future rename fails loudly instead of sending requests to
huggingface.co. A subprocess only needs ``HF_ENDPOINT`` in its environment (also set by ``patch_endpoint``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_oid(content: bytes) -> str:
    """The git blob hash (what the Hub reports as the ETag / oid of a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # oid -> {path: content}
    branches: dict[str, str] = field(default_factory=dict)  # name (main, refs/pr/1, ...) -> commit oid
    messages: dict[str, str] = field(default_factory=dict)  # commit oid -> summary
    num_prs: int = 0

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None

    def commit(self, parent: str | None, files: dict[str, bytes], summary: str) -> str:
        digest = hashlib.sha1(json.dumps([parent, summary, sorted((p, git_blob_oid(c)) for p, c in files.items())])
                              .encode())
        oid = digest.hexdigest()
        self.commits[oid] = files
        self.messages[oid] = summary
        return oid


class LoopbackHub:
    """``with LoopbackHub() as hub: ...`` (or ``start()`` / ``stop()``); ``hub.url`` is the endpoint."""

    def __init__(self, user: str = "user"):
        self.user = user
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> LoopbackHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="loopback-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> LoopbackHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- inspection -----------------------------------------------------------------------------------------------
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        with self.lock:
            repo = self.repos[repo_id]
            return dict(repo.commits[repo.resolve(revision)])

    def history(self, repo_id: str) -> list[str]:
        """Summaries of the repository's commits on every branch, oldest first."""
        with self.lock:
            return list(self.repos[repo_id].messages.values())

    # -- pointing huggingface_hub and transformers at the server -----------------------------------------------------
    def patch_endpoint(self, monkeypatch, cache_dir) -> None:
        """Route this process's ``huggingface_hub`` and transformers calls to this server (pytest ``monkeypatch``:
        undone after the test), online, with a fake token (never a real one) and the download cache in
        ``cache_dir`` (``push_to_hub`` downloads the repository's card into the default cache otherwise)."""
        import huggingface_hub
        from huggingface_hub import constants
        from transformers.utils import hub as transformers_hub

        monkeypatch.setenv("HF_ENDPOINT", self.url)
        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        template = self.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(transformers_hub, "_hf_api", None)  # transformers' shared HfApi, rebuilt on next use
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_loopback_fake_token")
        monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))  # read at call time by both libraries
        # The patch must have taken everywhere the upload and download paths read the endpoint.
        assert huggingface_hub.hf_hub_url("a/b", "c") == f"{self.url}/a/b/resolve/main/c"
        assert huggingface_hub.HfApi().endpoint == self.url
        assert transformers_hub.hf_api().endpoint == self.url


class _Handler(BaseHTTPRequestHandler):
    hub: LoopbackHub
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every response carries Content-Length

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- plumbing -------------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json", head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, payload, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self._send(status, json.dumps(payload).encode(), headers, head=head)

    def _error(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None,
               head: bool = False) -> None:
        extra = dict(headers or {})
        if code:
            extra["X-Error-Code"] = code
        extra["X-Error-Message"] = message
        self._json(status, {"error": message}, extra, head=head)

    def _route(self, method: str) -> None:
        parts = urlsplit(self.path)
        path, query = parts.path, parse_qs(parts.query)
        body = self._body() if method == "POST" else b""
        with self.hub.lock:
            self.hub.requests.append((method, path))
            segments = [unquote(s) for s in path.strip("/").split("/")]
            try:
                handled = self._dispatch(method, segments, query, body)
            except Exception as error:  # a bug here must show up in the test, not hang the client
                self._error(500, None, f"loopback hub error: {error!r}")
                return
            if not handled:
                self.hub.unhandled.append((method, path))
                self._error(404, None, f"loopback hub: no route for {method} {path}", head=method == "HEAD")

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._route("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    # -- endpoints ------------------------------------------------------------------------------------------------
    def _dispatch(self, method: str, seg: list[str], query: dict, body: bytes) -> bool:
        hub = self.hub
        if method == "POST" and seg == ["api", "repos", "create"]:
            payload = json.loads(body)
            if payload.get("type") not in (None, "model"):
                self._error(400, None, "loopback hub: model repositories only")
                return True
            repo_id = f"{payload.get('organization') or hub.user}/{payload['name']}"
            url = f"{hub.url}/{repo_id}"
            if repo_id in hub.repos:
                self._json(409, {"error": "You already created this model repo", "url": url})
                return True
            repo = hub.repos[repo_id] = Repo(repo_id)
            repo.branches["main"] = repo.commit(None, {".gitattributes": GITATTRIBUTES}, "initial commit")
            self._json(200, {"url": url, "name": repo_id})
            return True
        if method == "GET" and seg == ["api", "agent-harnesses"]:
            # huggingface_hub's best-effort user-agent telemetry; a 404 makes it give up without caching anything
            self._error(404, None, "not served by the loopback hub")
            return True
        if method == "POST" and seg == ["api", "validate-yaml"]:
            self._validate_yaml(json.loads(body).get("content", ""))
            return True
        if len(seg) >= 4 and seg[:2] == ["api", "models"]:
            return self._api_model(method, "/".join(seg[2:4]), seg[4:], query, body)
        if len(seg) >= 5 and seg[2] == "resolve" and method in ("GET", "HEAD"):
            self._resolve("/".join(seg[:2]), seg[3], "/".join(seg[4:]), head=method == "HEAD")
            return True
        return False

    def _repo_and_commit(self, repo_id: str, revision: str, head: bool = False):
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found", head=head)
            return None, None
        oid = repo.resolve(revision)
        if oid is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
            return repo, None
        return repo, oid

    def _api_model(self, method: str, repo_id: str, rest: list[str], query: dict, body: bytes) -> bool:
        if method == "GET" and (not rest or (len(rest) == 2 and rest[0] == "revision")):
            repo, oid = self._repo_and_commit(repo_id, rest[1] if rest else "main")
            if oid is not None:
                files = repo.commits[oid]
                self._json(200, {"id": repo_id, "modelId": repo_id, "sha": oid, "private": False,
                                 "disabled": False, "gated": False, "tags": [], "downloads": 0, "likes": 0,
                                 "siblings": [{"rfilename": p, "size": len(c)} for p, c in sorted(files.items())]})
            return True
        if method == "GET" and len(rest) >= 2 and rest[0] == "tree":  # snapshot_download's file listing (flat repos)
            repo, oid = self._repo_and_commit(repo_id, rest[1])
            if oid is not None:
                self._json(200, [{"type": "file", "path": p, "size": len(c), "oid": git_blob_oid(c)}
                                 for p, c in sorted(repo.commits[oid].items())])
            return True
        if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
            repo, oid = self._repo_and_commit(repo_id, rest[1])
            if oid is not None:
                existing = repo.commits[oid]
                files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                          "oid": git_blob_oid(existing[f["path"]]) if f["path"] in existing else None}
                         for f in json.loads(body)["files"]]
                self._json(200, {"files": files, "commitOid": oid})
            return True
        if method == "POST" and len(rest) == 2 and rest[0] == "commit":
            self._commit(repo_id, rest[1], body, create_pr=query.get("create_pr") == ["1"])
            return True
        return False

    def _commit(self, repo_id: str, revision: str, body: bytes, create_pr: bool) -> None:
        repo, parent = self._repo_and_commit(repo_id, revision)
        if parent is None:
            return
        files = dict(repo.commits[parent])
        summary = ""
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value.get("summary", "")
                if value.get("parentCommit") not in (None, parent):
                    self._error(412, None, "A commit has happened since. Please refresh and try again.")
                    return
            elif key == "file":
                if value.get("encoding") != "base64":
                    self._error(400, None, f"loopback hub: unsupported encoding {value.get('encoding')!r}")
                    return
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    self._error(404, "EntryNotFound", "A file with this name doesn't exist")
                    return
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: c for p, c in files.items() if not p.startswith(prefix)}
            else:  # lfsFile: never asked for, since preupload answers "regular"
                self._error(400, None, f"loopback hub: unsupported commit operation {key!r}")
                return
        oid = repo.commit(parent, files, summary)
        payload = {"commitUrl": f"{self.hub.url}/{repo_id}/commit/{oid}", "commitOid": oid, "success": True}
        if create_pr:
            repo.num_prs += 1
            repo.branches[f"refs/pr/{repo.num_prs}"] = oid
            payload["pullRequestUrl"] = f"{self.hub.url}/{repo_id}/discussions/{repo.num_prs}"
        elif revision in repo.branches:
            repo.branches[revision] = oid
        else:
            self._error(400, None, f"loopback hub: {revision} is not a branch")
            return
        self._json(200, payload)

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo, oid = self._repo_and_commit(repo_id, revision, head=head)
        if oid is None:
            return
        content = repo.commits[oid].get(path)
        if content is None:
            self._error(404, "EntryNotFound", f"{path} does not exist on {quote(revision)}",
                        {"X-Repo-Commit": oid}, head=head)
            return
        self._send(200, content, {"ETag": f'"{git_blob_oid(content)}"', "X-Repo-Commit": oid,
                                  "Accept-Ranges": "bytes"}, content_type="application/octet-stream", head=head)

    def _validate_yaml(self, content: str) -> None:
        import yaml

        errors = []
        if content.startswith("---"):
            header = content.split("---", 2)[1] if content.count("---") >= 2 else ""
            try:
                data = yaml.safe_load(header)
                if data is not None and not isinstance(data, dict):
                    errors.append({"message": "metadata must be a mapping"})
            except yaml.YAMLError as error:
                errors.append({"message": str(error)})
        self._json(400 if errors else 200, {"errors": errors, "warnings": []})
