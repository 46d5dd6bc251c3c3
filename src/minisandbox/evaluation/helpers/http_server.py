"""A test service's HTTP server, run inside the sandbox by the httpbin tools environment's python.

Serves httpbin's WSGI app (or, given a files directory, those files as the "web" service:
files/<host>/<path>, a directory's index.html, else 404) on 127.0.0.1 with a port the kernel
picks (nothing the tests bind can collide with it). Given public host names, also on ports 80
(HTTP) and 443 (HTTPS, with a certificate for those names from a CA made now, written to
<info>.ca.pem). Then publishes "<port> <pid>" atomically: once the file exists every socket
listens.

httpbin answers as httpbin.org did behind its front end (gunicorn, and a proxy keeping
connections alive), where the tests of old requests releases were written: a chunked request
body is read (httpbin refuses it from any server but gunicorn), and connections are kept alive
unless the request asks to close (werkzeug's server closes every one). For that each request's
body is read whole before the app runs, so the next request on the connection starts where
it should, and werkzeug's reading of what follows a response (meant for a closed connection:
here it would swallow the next request) is off.

argv: info-path files-directory-or-empty public-names...
"""

import io
import os
import ssl
import sys
import threading

import werkzeug.serving
from werkzeug.serving import DechunkedInput, WSGIRequestHandler, make_server

MAX_BODY = 256 << 20  # a test's request body, read whole


class _NothingToDrain:
    """werkzeug.serving's `selectors` as its post-response drain sees it: nothing readable."""

    class DefaultSelector:
        def register(self, *args):
            pass

        def select(self, timeout=None):
            return []

        def close(self):
            pass

    EVENT_READ = 1


werkzeug.serving.selectors = _NothingToDrain

if not sys.argv[2]:
    from httpbin import app as httpbin_app

    def app(environ, start_response):
        # A chunked body, de-chunked (wsgi.input_terminated): what gunicorn gives httpbin.
        if environ.get("wsgi.input_terminated"):
            environ["SERVER_SOFTWARE"] = "gunicorn/19.9.0"
        return httpbin_app(environ, start_response)


class Handler(WSGIRequestHandler):
    protocol_version = "HTTP/1.1"

    def make_environ(self):
        environ = super().make_environ()
        stream = environ["wsgi.input"]
        if isinstance(stream, DechunkedInput):
            body = stream.read(MAX_BODY + 1)
        else:
            length = environ.get("CONTENT_LENGTH") or "0"
            body = self.rfile.read(int(length)) if length.isdigit() else b""
        if len(body) > MAX_BODY:
            self.close_connection = True
        environ["wsgi.input"] = io.BytesIO(body[:MAX_BODY])
        return environ

    def send_header(self, keyword, value):
        if keyword.lower() == "connection" and sys.argv[2] == "":
            asked = (self.headers.get("Connection") or "").lower()
            value = "close" if asked == "close" else "keep-alive"
        super().send_header(keyword, value)


info, files, names = sys.argv[1], sys.argv[2], [n for n in sys.argv[3:] if n]
if files:  # the "web" service: files/<host>/<path>, else 404
    import mimetypes

    root = os.path.realpath(files)

    def app(environ, start_response):
        host = environ.get("HTTP_HOST", "").split(":")[0].lower()
        path = os.path.realpath(os.path.join(root, host, environ.get("PATH_INFO", "").lstrip("/")))
        if os.path.isdir(path):  # a directory's page: its index.html
            path = os.path.join(path, "index.html")
        if path.startswith(root + os.sep) and os.path.isfile(path):
            with open(path, "rb") as fh:
                body = fh.read()
            kind = mimetypes.guess_type(path)[0] or "application/octet-stream"
            start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body)))])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found"]


servers = [make_server("127.0.0.1", 0, app, threaded=True, request_handler=Handler)]
if names:
    import trustme

    ca = trustme.CA(organization_name="minisandbox test services")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert(*names).configure_cert(context)
    ca.cert_pem.write_to_path(info + ".ca.pem")
    servers.append(make_server("127.0.0.1", 80, app, threaded=True, request_handler=Handler))
    servers.append(
        make_server(
            "127.0.0.1", 443, app, threaded=True, ssl_context=context, request_handler=Handler
        )
    )
for server in servers[1:]:
    threading.Thread(target=server.serve_forever, daemon=True).start()
with open(info + ".tmp", "w") as f:
    f.write(f"{servers[0].socket.getsockname()[1]} {os.getpid()}\n")
os.rename(info + ".tmp", info)
servers[0].serve_forever()
