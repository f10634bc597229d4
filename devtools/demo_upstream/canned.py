"""Crafted answers, for tests of what the sidecar does with an upstream's odd bytes.

POST /admin/canned?count=N with any body and content type: the next N chat requests are
answered with exactly those bytes and that content type, status 200 (count 0 clears it).
A separate piece so the demo's own answers stay what its engine makes.
"""
from __future__ import annotations

from aiohttp import web

_CHAT_SUFFIX = "/chat/completions"
_KEY = web.AppKey("canned", dict)


def install(app: web.Application) -> None:
    app[_KEY] = {"body": b"", "content_type": "", "left": 0}
    app.middlewares.append(_answer_canned)
    app.router.add_post("/admin/canned", _set_canned)


async def _set_canned(request: web.Request) -> web.Response:
    try:
        count = int(request.query.get("count", "1"))
    except ValueError:
        count = -1
    if count < 0:
        return web.json_response({"error": {"message": "count: a whole number >= 0"}}, status=400)
    request.app[_KEY].update(body=await request.read(), left=count,
                             content_type=request.headers.get("content-type", "application/json"))
    return web.json_response({"left": count})


@web.middleware
async def _answer_canned(request: web.Request, handler):
    canned = request.app[_KEY]
    if request.method == "POST" and request.path.endswith(_CHAT_SUFFIX) and canned["left"] > 0:
        canned["left"] -= 1
        await request.read()
        return web.Response(body=canned["body"], headers={"content-type": canned["content_type"]})
    return await handler(request)
