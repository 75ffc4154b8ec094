"""The live page at / in a real browser: headless Chromium, driven over the DevTools protocol, loads the page,
submits a prompt, waits for the stream to end; the colored tokens must reassemble the response exactly (the
same request, not streamed) and the round chart must have one bar per round."""

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import urllib.request

import pytest
import websockets

from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.serving.app import BackgroundServer, create_app

MODEL = "smollm2-135m"
PROMPT = "Repeat this list exactly: red, green, blue, yellow, red, green, blue, yellow."
SCREENSHOT = os.environ.get("SPECDECODE_SCREENSHOT")  # where to keep the page's picture (docs/page.png)


class DevTools:
    """The few DevTools-protocol calls the test needs, over one page's websocket."""

    def __init__(self, socket) -> None:
        self.socket, self.next_id = socket, 0

    async def call(self, method: str, **params) -> dict:
        self.next_id += 1
        await self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.socket.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await self.evaluate(expression):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(expression)
            await asyncio.sleep(0.1)


def browser_executable() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("no Chromium found: install Debian's chromium package (.ci/run does this)")


@pytest.fixture(scope="module")
def page_server(smollm2):
    engine = ContinuousEngine(smollm2, NgramDrafter(), EngineConfig(max_batch=2, max_len=256, draft_length=6))
    with BackgroundServer(create_app(engine, MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium")
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-port=0"]
    process = subprocess.Popen(
        [browser_executable(), *flags, f"--user-data-dir={profile}", "about:blank"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stderr:
            found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if found:
                yield int(found.group(1))
                break
        else:
            pytest.fail("Chromium did not start its DevTools endpoint")
    finally:
        process.kill()
        process.wait()


async def _run_page(devtools_port: int, url: str) -> dict:
    targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{devtools_port}/json/list").read())
    page = next(t for t in targets if t["type"] == "page")
    async with websockets.connect(page["webSocketDebuggerUrl"], max_size=2**26) as socket:
        tools = DevTools(socket)
        await tools.call("Page.enable")
        await tools.call(
            "Emulation.setDeviceMetricsOverride", width=1000, height=700, deviceScaleFactor=1, mobile=False
        )
        await tools.call("Page.navigate", url=url)
        await tools.wait_for("document.body && document.body.dataset.state === 'ready'", timeout=30)
        await tools.evaluate(f"document.getElementById('prompt').value = {json.dumps(PROMPT)}")
        await tools.evaluate("document.getElementById('max_tokens').value = '48'")
        await tools.evaluate("document.getElementById('run').click()")
        await tools.wait_for("document.body.dataset.state === 'done'", timeout=240)
        found = await tools.evaluate(
            """({
              tokens: [...document.querySelectorAll('#output .token')].map(t => [t.textContent, t.dataset.source]),
              bars: document.querySelectorAll('#chart .bar').length,
              rounds: Number(document.body.dataset.rounds),
              text: document.body.dataset.text,
            })"""
        )
        found["screenshot"] = (await tools.call("Page.captureScreenshot", format="png"))["data"]
        await tools.evaluate("document.getElementById('compare').click()")  # the same request, no speculation
        await tools.wait_for("document.body.dataset.state === 'done'", timeout=240)
        found["normal_text"] = await tools.evaluate("document.body.dataset.text")
        found["speeds"] = await tools.evaluate("document.getElementById('speeds').textContent")
        return found


def test_the_page_streams_colored_tokens_and_one_bar_per_round(page_server, browser):
    found = asyncio.run(_run_page(browser, page_server.url + "/"))
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        page_server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    reference = json.loads(urllib.request.urlopen(request).read())
    text = reference["choices"][0]["message"]["content"]
    assert "".join(piece for piece, _ in found["tokens"]) == text == found["text"]
    assert all(source != "none" for _, source in found["tokens"])  # every character belongs to a token
    assert found["bars"] == found["rounds"] == reference["spec_decode"]["choices"][0]["rounds"]
    assert any(int(source) > 0 for _, source in found["tokens"])  # drafts were accepted and colored as such
    assert found["normal_text"] == text  # temperature 0: speculation changes the speed, never the text
    assert "speculative" in found["speeds"] and "normal" in found["speeds"]  # both speeds, side by side
    if SCREENSHOT:
        with open(SCREENSHOT, "wb") as picture:
            picture.write(base64.b64decode(found["screenshot"]))
