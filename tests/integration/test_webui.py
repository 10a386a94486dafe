"""The built-in chat page in a real browser (Debian's chromium, driven by Playwright): type, send, see the
streamed answer, stop one; under --api-key; off with --no-webui."""

from __future__ import annotations

import shutil

import httpx
import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


def _send(page, text: str, temperature: str, max_tokens: str) -> None:
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)
    page.fill("#prompt", text)
    page.click("#send")


def test_the_page_streams_the_answer_the_api_gives_and_stops_one(start_server, model_path, browser):
    proc = start_server("--quantization", "none", "--fibers", "2").wait_ready()
    try:
        question = "What is the capital of France?"
        with proc.client() as c:
            body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
                    "max_tokens": 16, "temperature": 0}  # fmt: skip
            expected = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        page = browser.new_page()
        page.goto(proc.url + "/")
        assert page.title() == "fiberserve"
        page.wait_for_function("document.getElementById('model').textContent.length > 0")
        page.fill("#system", "Be brief.")
        _send(page, question, "0", "16")
        answer = page.wait_for_selector(".assistant[data-finished]", timeout=60_000)
        assert answer.get_attribute("data-finished") == "stop"
        assert answer.query_selector(".text").text_content() == expected
        assert page.query_selector(".user .text").text_content() == question

        _send(page, "Write a very long story about a dragon.", "0.8", "4000")
        page.wait_for_function(
            "[...document.querySelectorAll('.assistant')].at(-1)?.querySelector('.text')?.textContent.length > 20",
            timeout=60_000,
        )
        page.click("#stop")
        stopped = page.wait_for_selector(".assistant:nth-of-type(4)[data-finished]", timeout=30_000)
        assert stopped.get_attribute("data-finished") == "abort"
        assert page.is_enabled("#send") and not page.is_enabled("#stop")
        proc.assert_idle()  # the stopped answer's request was aborted and its pages freed
        page.close()
    finally:
        assert proc.stop() == 0


def test_under_an_api_key_the_page_loads_and_its_requests_need_the_key(start_server, model_path, browser):
    proc = start_server("--api-key", "sesame", "--quantization", "none").wait_ready()
    try:
        assert httpx.get(proc.url + "/").status_code == 200
        assert httpx.post(proc.url + "/v1/chat/completions", json={"messages": []}).status_code == 401
        page = browser.new_page()
        page.goto(proc.url + "/")
        _send(page, "Hi", "0", "4")
        refused = page.wait_for_selector(".assistant[data-finished]", timeout=30_000)
        assert refused.get_attribute("data-finished") == "error"
        assert "API key" in refused.query_selector(".error").text_content()
        page.fill("#api-key", "sesame")
        _send(page, "Hi", "0", "4")
        answered = page.wait_for_selector(".assistant:nth-of-type(4)[data-finished]", timeout=60_000)
        assert answered.get_attribute("data-finished") == "stop" and answered.query_selector(".text").text_content()
        page.close()
    finally:
        assert proc.stop() == 0


def test_no_webui_serves_no_page():
    from fastapi.testclient import TestClient

    from fiberserve.config import ServerConfig
    from fiberserve.server.app import create_app

    for webui, status in ((False, 404), (True, 200)):
        client = TestClient(create_app(ServerConfig(webui=webui)))  # outside a with block: no lifespan, no load
        assert client.get("/").status_code == status
