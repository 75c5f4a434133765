"""The review page: a Gradio app over one review folder's store, served on 127.0.0.1 by `medbanana review`.

What reaches the browser is blind by construction: the handlers send only the item's images (opaque PNG names), its
instruction, its opaque number and the rater's progress — never the judge's verdict, the model, the round, the
outcome, the sample id or the stratum. The rater's name is kept in the browser's localStorage (gr.BrowserState,
under a key and secret derived from the review, so it survives a server restart), so a reload resumes at the item
the store holds for that rater. The time an item is shown and the item itself are kept on the server (gr.State): an
answer counts for the item this page session was shown (the store checks the rater's claim and K again).

Text that comes from data (the instruction, a rater's name, a message quoting either) is shown as plain text: the
instruction in a read-only textbox, the rest escaped for Markdown (`plain`), so no data makes the page load an image,
follow a link or grow a form. Gradio's file cache lives in a 0700 folder inside the review folder, removed when the
server stops, and its upload routes answer 401: served images never leave the review folder.

What is served is only the review's own images: a review.sqlite whose items name anything but the store's
content-derived `images/<digest>.png` names is refused before the server starts (`check_image_names`), and each image
is read on open as a regular file of the review's own images/ folder (never through a link) whose content still
hashes to its name; gradio is handed a copy of those bytes in its cache folder (`served_image`), never a path the
data names, and no folder is opened to it (`allowed_paths`). An item whose image fails is not shown: the page says so.
"""

import hashlib
import os
import re
import shutil
import tempfile
import time
from importlib import resources

from ..generation.dataset.review_folder import MAX_REASON, Answer, ReviewItem
from ..generation.extras import require
from .store import MAX_RATER_NAME, NotGiven, ReviewStore, check_rater_name
from ..generation.failures import EXIT_OK, UsageError

YES_NO = ("Yes", "No")
RUBRIC_QUESTIONS = (  # Answer field -> the question, in the judge rubric's order; `qualified` last
    ("has_disease", "Is the instruction's change done? (lesion present after an add, absent after a remove)"),
    ("structure_reasonable", "Is the anatomy / structure reasonable?"),
    ("looks_realistic", "Does the edited image look realistic?"),
    ("fidelity_preserved", "Is everything outside the edited region preserved?"),
    ("qualified", "Overall: is this an acceptable edit of the instruction (qualified)?"),
)
GUESS_CHOICES = (("Real (not edited)", "real"), ("Edited", "edited"))
CONFIDENCE_CHOICES = tuple((str(n), n) for n in range(1, 6))
IMAGE_HEIGHT = 360  # the instruction, two images and the questions fit a 1280x800 window
ALREADY_ANSWERED = "You had already answered that item (a double click or another tab): your first answer is kept."
NOT_SHOWN = "That item is not the one this page was showing you: nothing stored."
REASON_LABEL = (f"Reason (optional, at most {MAX_REASON:,} characters; no names, initials or patient identifiers: "
                "reasons may be published)")
NOT_SHOWABLE = "This item cannot be shown: {}. Tell whoever runs this review; nothing was stored."
REFUSED_ROUTES = ("/upload", "/process_recording")  # gradio routes that write files a client sends: off
CSS = """
.gradio-container { max-width: 1400px !important; padding-top: 4px !important; }
#review-header h3 { margin: 4px 0; }
#review-message p { font-weight: 600; }
#instruction textarea { max-height: 9em; overflow-y: auto; }  /* a very long instruction scrolls */
/* images fill their box, whatever their size */
:is(#image-source, #image-edit, #image-single) :is(button:has(.image-frame), .image-frame) {
    width: 100%; height: 100%; }
:is(#image-source, #image-edit, #image-single) img { width: 100%; height: 100%; object-fit: contain; }
/* one line per question, its choices on the right: every question and Submit fit a 1280x800 window */
#questions fieldset.block { display: flex; align-items: center; justify-content: space-between; gap: 8px;
                            padding: 4px 10px; }
#questions fieldset.block > span[data-testid="block-info"] { flex: 1; margin: 0; }
#questions fieldset.block > .wrap { flex-shrink: 0; }
/* the synced zoom (ZOOM_JS): a frame clips its zoomed image (gradio keeps the label and buttons above it) */
:is(#image-source, #image-edit) .image-frame { overflow: hidden; touch-action: none; }
:is(#image-source, #image-edit) img { -webkit-user-drag: none; user-select: none; }
#zoom-hint { padding: 0 !important; }
#zoom-hint p { margin: 0; font-size: var(--text-sm); color: var(--body-text-color-subdued); }
"""
ZOOM_HINT = "Scroll over an image to zoom both, drag to pan, double-click to reset (keys: + - 0 over an image)."
MAX_ZOOM = 8
# The synced zoom of the side-by-side images (zoom.js, run once when the page loads).
ZOOM_JS = resources.files("medbanana.review").joinpath("zoom.js").read_text(encoding="utf-8").replace(
    "__MAX_ZOOM__", str(MAX_ZOOM))


def load_gradio():
    """gradio, imported with its telemetry and update check off: the page must not reach the network."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    return require("gradio", needed_for="medbanana review", extra="review")


def on_space() -> bool:
    """Running in a Hugging Face Space: raters sign in with Hugging Face instead of typing a name."""
    return bool(os.environ.get("SPACE_ID"))


def plain(text: str) -> str:
    r"""`text` shown through Markdown as itself: every ASCII punctuation mark backslash-escaped (CommonMark), so no
    markup, link or image can come from data.

    >>> print(plain("![x](h.png) <b>"))
    \!\[x\]\(h\.png\) \<b\>
    """
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", str(text))


def bold(text: str) -> str:
    return f"**{plain(text)}**"


def review_key(store: ReviewStore) -> str:
    """A stable secret per review: the browser's saved rater name stays readable after a server restart, and one
    review's saved name is not another's."""
    settings = store.settings
    return hashlib.sha256(f"{store.path.resolve()}|{settings.created_at}|{settings.seed}".encode()).hexdigest()


def answer_from_page(mode: str, values: list, seconds: float | None) -> Answer:
    """The page's inputs as an Answer: rubric (five Yes/No radios, a reason) or realism (guess, confidence)."""
    if mode == "rubric":
        *choices, reason = values
        flags = {name: None if value is None else value == "Yes"
                 for (name, _), value in zip(RUBRIC_QUESTIONS, choices)}
        return Answer(**flags, reason=(reason or "").strip(), seconds=seconds)
    guess, confidence = values
    return Answer(guess=guess, confidence=None if confidence is None else int(confidence), seconds=seconds)


def build_page(store: ReviewStore, cache: str | None = None):
    """The gr.Blocks page for this review (its mode fixed at creation). The images it shows are copies, in `cache`
    (default: gradio's own folder), of the review's images checked on open (`served_image`)."""
    gr = load_gradio()
    cache = cache or tempfile.gettempdir()
    mode = store.settings.mode
    key = review_key(store)
    login = on_space()
    if login:  # gradio's sign-in needs its `oauth` extra (pyproject's review extra asks for gradio[oauth])
        require("authlib", "itsdangerous", needed_for="signing in with Hugging Face on a Space", extra="review")

    with gr.Blocks(title="medbanana review", analytics_enabled=False) as page:
        saved_rater = gr.BrowserState(None, storage_key=f"medbanana-review-{key[:12]}", secret=key[12:44])
        shown = gr.State(None)  # {"item": id, "at": monotonic seconds}: the answer time, measured on the server
        # the item this page shows, sent with every submit: a late second submit names its own item, never the next
        item_box = gr.Textbox(visible=False, elem_id="item-id")
        with gr.Row(equal_height=True):
            header = gr.Markdown("### Blind review", elem_id="review-header")
            message = gr.Markdown("", elem_id="review-message")

        with gr.Column(visible=False, elem_id="sign-in") as sign_in:
            gr.Markdown("Enter your name or initials to start. Answers are saved as you go; come back with the same "
                        "name to continue where you stopped. You will not see how the edits were judged. In the "
                        "optional reasons, write no names, initials or patient identifiers: they may be published.")
            if login:
                gr.LoginButton()
            with gr.Row():
                name_box = gr.Textbox(label="Your name or initials", max_length=MAX_RATER_NAME, scale=3,
                                      elem_id="rater-name")
                start = gr.Button("Start", variant="primary", scale=1, elem_id="start")

        with gr.Column(visible=False, elem_id="item-view") as item_view:
            # full width, plain text (never markup): an instruction may run to five lines
            instruction = gr.Textbox(label="Instruction", interactive=False, lines=1, max_lines=6,
                                     elem_id="instruction")
            with gr.Row():
                images = _image_column(gr, mode)
                questions, submit, switch = _question_column(gr, mode)

        finished = gr.Markdown(visible=False, elem_id="finished")
        page_outputs = [saved_rater, shown, item_box, header, message, sign_in, item_view, finished, instruction,
                        *images, *questions]

        def show_next(rater: str, note: str = "") -> dict:
            """Everything the page shows for `rater` now: their held or next item, or the thank-you."""
            item = store.next_item(rater)
            done, total = store.progress(rater)
            out = {saved_rater: rater, message: note, sign_in: gr.update(visible=False)}
            if item is None:
                return {**out, shown: None, item_box: "", header: f"### Blind review · {plain(rater)}",
                        item_view: gr.update(visible=False),
                        finished: gr.update(visible=True, value=_thanks(rater, done))}
            try:
                pictures = _image_values(store, item, images, cache)
            except ValueError as exc:  # an image that is not the review's own: refused, never served
                return {**out, shown: None, item_box: "", message: bold(NOT_SHOWABLE.format(exc)),
                        item_view: gr.update(visible=False), finished: gr.update(visible=False)}
            return {**out, shown: {"item": item.item_id, "at": time.monotonic()}, item_box: item.item_id,
                    header: f"### Blind review · {plain(rater)} · item {done + 1} of {total} ({item.item_id})",
                    item_view: gr.update(visible=True), finished: gr.update(visible=False),
                    instruction: gr.update(**_instruction(item)), **pictures,
                    **{question: None for question in questions[:-1]},
                    questions[-1]: "" if mode == "rubric" else None}

        def ask_name(note: str = "") -> dict:
            return {saved_rater: None, shown: None, item_box: "", header: "### Blind review", message: note,
                    sign_in: gr.update(visible=True), item_view: gr.update(visible=False),
                    finished: gr.update(visible=False)}

        def on_load(saved, profile: gr.OAuthProfile | None = None):
            name = profile.username if (login and profile is not None) else saved
            try:
                return show_next(check_rater_name(name)) if name else ask_name()
            except ValueError as exc:
                return ask_name(bold(exc))

        def on_start(name, profile: gr.OAuthProfile | None = None):
            if login and profile is not None:
                name = profile.username
            try:
                rater = check_rater_name(name)
            except ValueError as exc:
                return ask_name(bold(exc))
            return show_next(rater)

        def on_submit(rater, item_id, shown_now, *values):
            try:
                rater = check_rater_name(rater)
            except ValueError as exc:
                return ask_name(bold(exc))
            if not item_id:
                return show_next(rater)
            if not shown_now or shown_now.get("item") != item_id:  # a late submit of an item shown before, or a
                answered = store.answered(rater, item_id)          # client naming an item it was never shown
                return show_next(rater, bold(ALREADY_ANSWERED if answered else NOT_SHOWN))
            seconds = round(time.monotonic() - shown_now["at"], 3)
            try:
                stored = store.submit(rater, item_id, answer_from_page(mode, list(values), seconds))
            except ValueError as exc:  # incomplete: nothing stored, the same item stays
                return {message: bold(exc)}
            except NotGiven as exc:
                return show_next(rater, bold(exc))
            return show_next(rater, plain(f"Saved your answer to {item_id}.") if stored else bold(ALREADY_ANSWERED))

        page.load(on_load, inputs=[saved_rater], outputs=page_outputs)
        for trigger in (start.click, name_box.submit):
            trigger(on_start, inputs=[name_box], outputs=page_outputs)
        submit.click(on_submit, inputs=[saved_rater, item_box, shown, *questions], outputs=page_outputs,
                     trigger_mode="once")
        switch.click(lambda: ask_name(), outputs=page_outputs)
    return page


def _image_column(gr, mode: str) -> list:
    """rubric: the source and the edit side by side, and a slider over both (a tab each); realism: one image."""
    with gr.Column(scale=3):
        if mode != "rubric":
            return [_image(gr, "Image", "image-single")]
        with gr.Tabs():
            with gr.Tab("Side by side"):
                with gr.Row():
                    source_image = _image(gr, "Source", "image-source")
                    edited_image = _image(gr, "Edit", "image-edit")
                gr.Markdown(ZOOM_HINT, elem_id="zoom-hint")
            with gr.Tab("Compare with a slider"):
                slider = gr.ImageSlider(label="Source | edit (drag to compare)", type="filepath", interactive=False,
                                        height=IMAGE_HEIGHT, max_height=IMAGE_HEIGHT, buttons=["fullscreen"],
                                        elem_id="image-slider")
    return [source_image, edited_image, slider]


def _question_column(gr, mode: str) -> tuple[list, object, object]:
    """The questions of the mode (their values are answer_from_page's inputs), Submit and Change rater."""
    with gr.Column(scale=2, elem_id="questions"):
        if mode == "rubric":
            questions = [gr.Radio(list(YES_NO), label=text, elem_id=f"q-{name}") for name, text in RUBRIC_QUESTIONS]
            questions.append(gr.Textbox(label=REASON_LABEL, lines=1, max_lines=3, max_length=MAX_REASON,
                                        elem_id="reason"))
        else:
            questions = [gr.Radio(list(GUESS_CHOICES), label="Is this image real or edited?", elem_id="q-guess"),
                         gr.Radio(list(CONFIDENCE_CHOICES), label="How sure are you? (1 = a guess, 5 = certain)",
                                  elem_id="q-confidence")]
        with gr.Row():
            submit = gr.Button("Submit answer", variant="primary", scale=2, elem_id="submit")
            switch = gr.Button("Not you? Change rater", variant="secondary", size="sm", scale=1,
                               elem_id="change-rater")
    return questions, submit, switch


def _image(gr, label: str, elem_id: str):
    return gr.Image(label=label, type="filepath", interactive=False, height=IMAGE_HEIGHT, buttons=["fullscreen"],
                    elem_id=elem_id)


def _image_values(store: ReviewStore, item: ReviewItem, images: list, cache: str) -> dict:
    paths = [served_image(store, name, cache) for name in item.images]
    if len(images) == 3:  # rubric: source, edit, and the slider over both
        return {images[0]: paths[0], images[1]: paths[1], images[2]: (paths[0], paths[1])}
    return {images[0]: paths[0]}


def served_image(store: ReviewStore, name: str, cache: str) -> str:
    """A copy in `cache` of one of the review's images, read and checked on open (ReviewFolder.read_image: the
    store's content-derived name, a regular file of the review's own images/ folder, never a link): what gradio is
    handed, so that it never opens a path the review's data names. ValueError naming what is wrong."""
    data = store.read_image(name)
    copy = os.path.join(cache, "served", os.path.basename(name))
    os.makedirs(os.path.dirname(copy), mode=0o700, exist_ok=True)
    if not os.path.isfile(copy):
        tmp = f"{copy}.{os.getpid()}.{time.monotonic_ns()}"
        with open(tmp, "xb") as out:
            out.write(data)
        os.replace(tmp, copy)
    return copy


def _instruction(item: ReviewItem) -> dict:
    """The instruction box's label and value: the text as it is (the textbox never renders markup)."""
    if item.shown == "pair":
        return {"label": "Instruction given to the editor", "value": item.instruction}
    return {"label": "Look at the image", "value": "Is it a real image, or was it edited by a model?"}


def _thanks(rater: str, done: int) -> str:
    items = "item" if done == 1 else "items"
    return (f"## Thank you, {plain(rater)}!\n\nYou answered {done} {items}; nothing is left for you in this review. "
            "You can close this page.")


def refuse_uploads(request) -> str | None:
    """gradio's auth_dependency: every route is open to the page ("rater": raters sign in on the page itself), but
    the routes that write a client's files answer 401."""
    return None if request.url.path.rstrip("/").endswith(REFUSED_ROUTES) else "rater"


def serve(store: ReviewStore, host: str = "127.0.0.1", port: int = 7860) -> int:
    """Serve the page until Ctrl+C (or the process is stopped); every answer is on disk as soon as it is given."""
    # gradio copies every image it serves into its cache: a 0700 folder of the review's own, set before gradio is
    # imported (it reads GRADIO_TEMP_DIR then and when each component is made), removed when the server stops
    cache = tempfile.mkdtemp(prefix=".gradio-cache-", dir=store.folder)
    os.environ["GRADIO_TEMP_DIR"] = cache
    try:
        return _serve_page(store, host, port, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _serve_page(store: ReviewStore, host: str, port: int, cache: str) -> int:
    store.check_image_names()  # a review.sqlite naming other files: refused before anything is served
    page = build_page(store, cache)
    page.queue(default_concurrency_limit=8)  # the store serialises what must be; raters need not wait for each other
    settings = store.settings
    try:
        page.launch(server_name=host, server_port=port, share=False, inbrowser=False, quiet=True, ssr_mode=False,
                    prevent_thread_lock=True, footer_links=[], run_history=False,
                    mcp_server=False, enable_monitoring=False, css=CSS, js=ZOOM_JS, auth_dependency=refuse_uploads)
    except OSError as exc:  # the port is taken, or the host is not this machine's
        reason = "the port is in use" if "empty port" in str(exc) else str(exc)
        raise UsageError(f"cannot serve on {host}:{port}: {reason}; choose another --port") from exc
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    print(f"Review {store.folder} ({settings.mode}, {len(store.items())} items, {settings.raters_per_item} raters "
          f"per item) is served at:\n\n    http://{shown_host}:{port}/\n\n"
          "Open it in a browser; each rater enters a name. Stop with Ctrl+C: every answer given is already saved, "
          f"and `medbanana review {store.folder}` serves it again.", flush=True)
    try:
        while page.is_running:
            time.sleep(0.2)
    except KeyboardInterrupt:
        print(f"stopped: every answer given is saved in {store.path}", flush=True)
    finally:
        page.close()
    return EXIT_OK
