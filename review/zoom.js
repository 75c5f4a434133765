() => {
  // The review page's synced zoom (review/app.py passes it to launch(js=...); it runs once when the page loads).
  // One view, a scale and an offset as fractions of the frame, for both side-by-side images, so a rater zooms into the
  // same spot of the source and the edit. Listeners sit on the document because gradio re-renders the images; a
  // change of either image (the next item) resets the view. MAX is app.py's MAX_ZOOM, filled in there.
  const FRAMES = ["#image-source .image-frame", "#image-edit .image-frame"], MAX = __MAX_ZOOM__;
  const view = {scale: 1, x: 0, y: 0, images: ""};
  let drag = null, hovered = null;
  const frames = () => FRAMES.map(css => document.querySelector(css)).filter(Boolean);
  const images = () => frames().map(f => (f.querySelector("img") || {}).src || "").join("|");
  const frameOf = el => (el instanceof Element ? el.closest(FRAMES.join(",")) : null);
  const clamp = (v, lo, hi) => Math.min(hi, Math.max(lo, v));
  const apply = () => {  // the image always covers its frame: no empty band when panning
    view.x = clamp(view.x, 1 - view.scale, 0);
    view.y = clamp(view.y, 1 - view.scale, 0);
    for (const frame of frames()) {
      const img = frame.querySelector("img");
      if (!img) continue;
      img.style.transformOrigin = "0 0";
      img.style.transform = view.scale === 1 ? "" :
        `translate(${view.x * 100}%, ${view.y * 100}%) scale(${view.scale})`;
      frame.style.cursor = view.scale === 1 ? "" : (drag ? "grabbing" : "grab");
    }
  };
  const reset = () => { Object.assign(view, {scale: 1, x: 0, y: 0, images: images()}); drag = null; apply(); };
  const zoomAt = (frame, clientX, clientY, factor) => {  // the point under the pointer stays where it is
    const box = frame.getBoundingClientRect();
    const u = (clientX - box.left) / box.width, v = (clientY - box.top) / box.height;
    const scale = clamp(view.scale * factor, 1, MAX);
    view.x = u - (u - view.x) * scale / view.scale;
    view.y = v - (v - view.y) * scale / view.scale;
    Object.assign(view, {scale, images: images()});
    apply();
  };
  document.addEventListener("wheel", e => {
    const frame = frameOf(e.target);
    if (!frame) return;
    e.preventDefault();
    const pixels = e.deltaY * (e.deltaMode === 1 ? 16 : e.deltaMode === 2 ? 400 : 1);
    zoomAt(frame, e.clientX, e.clientY, Math.exp(-pixels / 500));
  }, {passive: false});
  document.addEventListener("pointerdown", e => {
    const frame = frameOf(e.target);
    if (!frame || view.scale === 1 || e.button !== 0) return;
    e.preventDefault();
    const box = frame.getBoundingClientRect();
    drag = {id: e.pointerId, x: e.clientX, y: e.clientY, width: box.width, height: box.height};
    frame.setPointerCapture(e.pointerId);
    apply();
  });
  document.addEventListener("pointermove", e => {
    hovered = frameOf(e.target) ? {frame: frameOf(e.target), x: e.clientX, y: e.clientY} : null;
    if (!drag || e.pointerId !== drag.id) return;
    view.x += (e.clientX - drag.x) / drag.width;
    view.y += (e.clientY - drag.y) / drag.height;
    Object.assign(drag, {x: e.clientX, y: e.clientY});
    apply();
  });
  for (const type of ["pointerup", "pointercancel"])
    document.addEventListener(type, e => { if (drag && e.pointerId === drag.id) { drag = null; apply(); } });
  document.addEventListener("dragstart", e => { if (frameOf(e.target)) e.preventDefault(); });
  document.addEventListener("dblclick", e => { if (frameOf(e.target)) reset(); });
  document.documentElement.addEventListener("pointerleave", () => { hovered = null; });
  document.addEventListener("keydown", e => {  // + - 0 over a hovered or focused image; never while typing
    if (e.ctrlKey || e.metaKey || e.altKey || (e.target instanceof Element && e.target.closest(
        "input:not([type=radio]):not([type=checkbox]), textarea, [contenteditable]"))) return;
    const focused = document.activeElement && document.activeElement.closest("#image-source, #image-edit");
    const frame = hovered ? hovered.frame : focused && focused.querySelector(".image-frame");
    if (!frame || !["+", "=", "-", "0"].includes(e.key)) return;
    e.preventDefault();
    if (e.key === "0") return reset();
    const box = frame.getBoundingClientRect();
    const [x, y] = hovered ? [hovered.x, hovered.y] : [box.left + box.width / 2, box.top + box.height / 2];
    zoomAt(frame, x, y, e.key === "-" ? 0.8 : 1.25);
  });
  new MutationObserver(() => { if (images() !== view.images) reset(); else if (view.scale !== 1) apply(); })
    .observe(document.body, {subtree: true, childList: true, attributes: true, attributeFilter: ["src"]});
}
