"""The offline simulator backend: runs the whole pipeline with no API key, honestly, from pixels.

    writer.py     TemplateWriter: round-1 templates and a refiner that reads the full history
    params.py     the instruction vocabulary <-> numeric edit parameters (shared by writer and editor)
    editor.py     SimulatedEditor: seeded, region-aware synthesis/removal of the 20 findings
    lesions*.py   the lesion models (chest; brain and fundus) and the shared lesion-evidence measure
    anatomy.py    landmarks and region masks estimated from each image
    judge.py      PixelJudge: rubric verdicts from measurements of original vs edited pixels
    phantoms.py   demo sources: chest/brain phantoms and variations of skimage.data.retina()
    imaging.py    resampling, smoothing and noise helpers
"""
