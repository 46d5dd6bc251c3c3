"""Ready means serving, not only listening: one request through the real server (any HTTP answer:
the web service answers 404 where httpbin answers 200). argv: port."""

import sys
import urllib.error
import urllib.request

try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/get", timeout=5).close()
except urllib.error.HTTPError:
    pass
