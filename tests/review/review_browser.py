"""Helpers of the review page's browser tests: a tiny run to review, the real `medbanana review` server process on a
free 127.0.0.1 port, and headless Chromium (Debian's chromium + chromedriver) driving the page through Selenium."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's chromium and chromium-driver packages
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WINDOW = (1280, 800)
SERVER_START_SECONDS = 120  # gradio's import alone takes 10-20 s on a busy machine


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (no Chromium or no chromedriver), or None."""
    for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)):
        if not Path(path).is_file():
            return f"{name} is not installed (Debian: apt-get install chromium chromium-driver)"
    return None


def make_run(root: Path, *, seed: int = 4) -> tuple[Path, Path]:
    """A small run directory with verdicts (two datasets, three tasks each) and its sources: (run, sources)."""
    from medbanana.builder.synthetic_run import make_synthetic_run

    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=3, datasets=("mimic_ours_cxr", "brain_ours_mri"),
                       sources_dir=root / "sources", image_size=96, seed=seed)
    return root / "run", root / "sources"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def medbanana_command() -> list[str]:
    script = Path(sys.executable).with_name("medbanana")
    return [str(script)] if script.exists() else [sys.executable, "-m", "medbanana"]


class ReviewServer:
    """`medbanana review ARGS --port PORT` as a real process; `kill()` is SIGKILL, `stop()` is Ctrl+C (SIGINT)."""

    def __init__(self, args: list[str], port: int, log: Path, env: dict | None = None):
        self.args, self.port, self.log_path, self.env = [str(a) for a in args], port, log, env or {}
        self.url = f"http://127.0.0.1:{port}/"
        self.proc: subprocess.Popen | None = None
        self.log = None

    def start(self) -> ReviewServer:
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("SPACE_ID", None)
        self.log = open(self.log_path, "a")  # noqa: SIM115 (the process writes to it until kill() or stop())
        self.proc = subprocess.Popen([*medbanana_command(), "review", *self.args, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the review server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url, timeout=2) as response:
                    if response.status == 200 and self.url in self.output():  # it printed where to go
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        self.kill()
        raise AssertionError(f"the review server did not answer on {self.url}:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()

    def stop(self) -> int:
        """Ctrl+C, as a rater's host would; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.proc.returncode


def new_browser():
    """Headless Chromium at 1280x800 with a fresh profile (its own localStorage), kept off the network."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="review-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    driver.profile_dir = profile
    return driver


def close_browser(driver) -> None:
    try:
        driver.quit()
    finally:
        shutil.rmtree(driver.profile_dir, ignore_errors=True)


class ReviewPage:
    """What a rater does on the page, and what they see (through the page's element ids)."""

    def __init__(self, driver, url: str):
        self.driver, self.url = driver, url

    # ---------------------------------------------------------------- reading

    def find(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def text(self, elem_id: str) -> str:
        from selenium.common.exceptions import NoSuchElementException

        try:
            element = self.find(f"#{elem_id}")
        except NoSuchElementException:
            return ""
        return element.text if element.is_displayed() else ""

    def instruction(self) -> str:
        """The instruction as the page shows it: a read-only textbox's text (never rendered as markup)."""
        return self.find("#instruction textarea").get_attribute("value")

    def header(self) -> str:
        return self.text("review-header")

    def message(self) -> str:
        return self.text("review-message")

    def item(self) -> str | None:
        """The opaque item number the page shows, or None (one script call: the tests poll it)."""
        header = self.driver.execute_script(
            "const view = document.getElementById('item-view');"
            "return view && view.offsetParent !== null ? document.getElementById('review-header').innerText : '';")
        found = re.search(r"\((item-\d+)\)", header or "")
        return found.group(1) if found else None

    def progress(self) -> tuple[int, int] | None:
        found = re.search(r"item (\d+) of (\d+)", self.header())
        return (int(found.group(1)), int(found.group(2))) if found else None

    def wait(self, condition, what: str, seconds: float = 30):
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(self.driver, seconds, poll_frequency=0.1).until(lambda _: condition())
        except Exception as exc:
            raise AssertionError(f"waited {seconds} s for {what}; header {self.header()!r}, message "
                                 f"{self.message()!r}") from exc

    # ---------------------------------------------------------------- doing

    def open(self) -> ReviewPage:
        self.driver.get(self.url)
        self.wait(lambda: self.item() or self.text("sign-in") or self.text("finished"), "the page to load", 60)
        return self

    def reload(self) -> ReviewPage:
        self.driver.refresh()
        self.wait(lambda: self.item() or self.text("sign-in") or self.text("finished"), "the page to reload", 60)
        return self

    def sign_in(self, name: str) -> None:
        box = self.find("#rater-name textarea, #rater-name input")
        box.clear()
        box.send_keys(name)
        self.find("#start").click()

    def choose(self, question: str, value) -> None:
        self.find(f"#q-{question} input[value='{value}']").click()

    def choices(self) -> dict:
        """{(question, value): its radio input} for every question on the page, in one script call."""
        found = self.driver.execute_script(
            "return [...document.querySelectorAll('#questions fieldset input[type=radio]')]"
            ".map(input => [input.closest('fieldset').id, input.value, input]);")
        return {(question.removeprefix("q-"), value): element for question, value, element in found}

    def answer_rubric(self, answers: dict, reason: str = "") -> None:
        """Click Yes or No for each question and type the reason: one chain of real pointer and key events."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        choices = self.choices()
        chain = ActionChains(self.driver, duration=0)  # no 250 ms glide to each radio
        for name, yes in answers.items():
            chain.click(choices[(name, "Yes" if yes else "No")])
        if reason:
            box = self.find("#reason textarea, #reason input")
            chain.click(box).key_down(Keys.CONTROL).send_keys("a").key_up(Keys.CONTROL).send_keys(Keys.DELETE)
            chain.send_keys(reason)
        chain.perform()

    def submit(self, *, double: bool = False) -> None:
        button = self.find("#submit")
        if double:
            from selenium.webdriver.common.action_chains import ActionChains

            ActionChains(self.driver, duration=0).double_click(button).perform()
        else:
            button.click()

    def submit_and_wait(self, *, double: bool = False) -> str:
        """Submit and wait for the page to move on (the next item, or the thank-you); the message it shows."""
        before = self.item()
        self.submit(double=double)
        self.wait(lambda: self.item() != before or self.text("finished"), f"the page to move on from {before}")
        return self.message()

    # ---------------------------------------------------------------- the side-by-side images' zoom

    def image_boxes(self) -> dict:
        """{elem_id: {"frame", "image": [left, top, width, height], "overflow", "src"}} for the source and the edit:
        where the browser draws each image and the frame that must clip it (one script call)."""
        return self.driver.execute_script(
            "const box = el => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };"
            "return Object.fromEntries(['image-source', 'image-edit'].map(id => {"
            "  const frame = document.querySelector(`#${id} .image-frame`), img = frame.querySelector('img');"
            "  return [id, {frame: box(frame), image: box(img), overflow: getComputedStyle(frame).overflow,"
            "               src: img.src}]; }));")

    def shows_at(self, x: float, y: float, css: str) -> bool:
        """Whether what a rater sees at the window point (x, y) (the topmost element there) is inside `css`."""
        return self.driver.execute_script(
            "const el = document.elementFromPoint(arguments[0], arguments[1]);"
            "return Boolean(el && el.closest(arguments[2]));", x, y, css)

    def wheel(self, elem_id: str, delta_y: int, *, at: tuple[int, int] = (0, 0), times: int = 1) -> None:
        """Turn the mouse wheel over an image, `at` pixels from its centre (negative delta_y: away from the rater)."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.actions.wheel_input import ScrollOrigin

        origin = ScrollOrigin.from_element(self.find(f"#{elem_id} img"), *at)
        for _ in range(times):
            ActionChains(self.driver).scroll_from_origin(origin, 0, delta_y).perform()

    def drag_image(self, elem_id: str, dx: int, dy: int) -> None:
        from selenium.webdriver.common.action_chains import ActionChains

        (ActionChains(self.driver).click_and_hold(self.find(f"#{elem_id} img")).move_by_offset(dx, dy).release()
         .perform())

    def double_click_image(self, elem_id: str) -> None:
        from selenium.webdriver.common.action_chains import ActionChains

        ActionChains(self.driver).double_click(self.find(f"#{elem_id} img")).perform()

    def key_over_image(self, elem_id: str, key: str) -> None:
        """Press a key with the pointer resting on an image (nothing focused: the page has the keyboard)."""
        from selenium.webdriver.common.action_chains import ActionChains

        ActionChains(self.driver).move_to_element(self.find(f"#{elem_id} img")).send_keys(key).perform()


def assert_offline(page: ReviewPage) -> None:
    """Everything the page loaded came from the review server: no fonts, scripts or telemetry from elsewhere."""
    loaded = page.driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    elsewhere = [url for url in loaded if not url.startswith((page.url, "data:", "blob:"))]
    assert loaded and not elsewhere, f"the page loaded {elsewhere}"
