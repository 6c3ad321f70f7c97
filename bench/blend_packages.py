"""The `packages` CacheBlend workload's text: what the installed packages say about themselves.

The texts are the long descriptions (METADATA) and license files of the distributions that
`make install` puts in place for `kvstore[dev]`: kvstore's requirements and theirs, followed
through their extras and markers, so the same set is found on every machine the project is
installed on (kvstore's own README is left out: it is this project's text). READMEs come in
Markdown and reStructuredText, with code, lists, tables and changelogs; licenses are legal prose.
Lines that carry only markup (HTML tags, badges, image directives) are dropped; texts that open
with the same paragraph of substance (copies of one license under other copyright lines) are
kept once.

The text depends on the installed versions: `distributions()` names them, and the bench writes
them into its report. Questions and needles differ from the language-reference workload in
form: needles are other facts (a port, a queue, a checklist item, a checksum prefix) with
numbers of 3-5 digits at any paragraph of a document, and other questions ask for a summary,
two features, how to start, or a license's terms.
"""
from __future__ import annotations

import importlib.metadata as metadata
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.requirements import Requirement

if TYPE_CHECKING:
    from bench.blend_workload import Document, Needle

ROOT = ("kvstore", frozenset({"dev"}))  # what `make install` installs: pip install -e ".[dev]"
NAMES = ("Ines Carvalho", "Rafael Ortiz", "Hana Kobayashi", "Olu Adeyemi", "Greta Svensson", "Yusuf Demir",
         "Chloe Martin", "Arjun Mehta", "Nadia Petrova", "Samuel Osei")
_MARKUP_LINE = re.compile(r"^\s*(<[^>]*>\s*)+$|^\s*\[?!\[|^\s*\.\. (image|figure|raw|\|)|^\s*:(target|alt|width|height"
                          r"|align):|^\s*<!--|-->\s*$|shields\.io|badge", re.IGNORECASE)
_LICENSE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE)", re.IGNORECASE)


def distributions() -> dict[str, str]:
    """{name: version} of the installed distributions `kvstore[dev]` requires, directly or not."""
    seen: dict[str, set[str]] = {}
    pending = [ROOT]
    while pending:
        name, extras = pending.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement not installed here (a GPU extra, another platform)
        if key in seen and extras <= seen[key]:
            continue
        seen.setdefault(key, set()).update(extras)
        environments = [{"extra": e} for e in (*extras, "")]
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate(env) for env in environments):
                pending.append((req.name, frozenset(req.extras)))
    return {key: metadata.distribution(key).version for key in sorted(seen) if key != ROOT[0]}


def paragraphs_of(text: str) -> list[str]:
    kept = "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").splitlines()
                     if not _MARKUP_LINE.search(line))
    return [p.strip("\n") for p in re.split(r"\n\s*\n", kept) if p.strip()]


def _read(dist: metadata.Distribution, file: metadata.PackagePath) -> str:
    try:
        return Path(str(dist.locate_file(file))).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""  # listed in RECORD but not readable here: no text, like an empty file


def sameness(paragraphs: list[str]) -> str:
    """What makes two texts the same document: the opening of their first paragraph of substance.
    Copies of one license differ in their copyright lines and headings, not in that."""
    for p in paragraphs:
        flat = " ".join(p.lower().split())
        if len(flat) >= 60 and not flat.startswith(("copyright", "(c)", "all rights reserved")):
            return flat[:150]
    return " ".join(" ".join(paragraphs).lower().split())


class PackageDocs:
    name = "packages"
    system_prompt = ("You answer questions about Python packages. Below are excerpts from their "
                     "documentation and license files; use only them, and keep the answer short.")
    config_defaults = {"doc_tokens": (80, 700), "docs_per_prompt": (2, 10), "pool_docs": 60}
    max_pieces = 5  # the first pieces of each text: a long changelog should not fill the pool

    def texts(self) -> list[tuple[str, list[str]]]:
        """(title, paragraphs): each distribution's description, then each of its license files."""
        out: list[tuple[str, list[str]]] = []
        seen: set[str] = set()
        for name in distributions():
            dist = metadata.distribution(name)
            description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
            files = sorted((f for f in dist.files or [] if ".dist-info" in str(f) and _LICENSE_FILE.match(f.name)),
                           key=str)
            texts = [(f"{name}: package description", description)]
            texts += [(f"{name}: {f.name}", _read(dist, f)) for f in files]
            for title, text in texts:
                paragraphs = paragraphs_of(text)
                key = sameness(paragraphs)
                if paragraphs and key not in seen:
                    seen.add(key)
                    out.append((title, paragraphs))
        return out

    def piece(self, title: str, part: int, paragraphs: list[str]) -> str:
        heading = f"[{title}]" if part == 1 else f"[{title}, continued ({part})]"
        return heading + "\n\n" + "\n\n".join(paragraphs) + "\n\n"

    def needle(self, rng: random.Random) -> "Needle":
        from bench.blend_workload import Needle

        name, number = rng.choice(NAMES), str(rng.randint(100, 99999))
        form = rng.randrange(4)
        if form == 0:
            return Needle(f"{name} runs the offline mirror of this project, which listens on port {number}.",
                          f"On which port does the offline mirror run by {name} listen?", number)
        if form == 1:
            return Needle(f"Support requests for this package are filed in queue number {number}.",
                          "According to the excerpts, which queue number are support requests filed in? "
                          "Reply with just the number.", number)
        if form == 2:
            return Needle(f"During the last packaging audit, {name} signed off checklist item {number}.",
                          f"Which checklist item did {name} sign off during the last packaging audit?", number)
        return Needle(f"Packagers: the reproducible-build checksum prefix of this release is {number}.",
                      "What is the reproducible-build checksum prefix of the release? Give the number only.",
                      number)

    def needle_place(self, rng: random.Random, paragraphs: int) -> int:
        return rng.randint(1, paragraphs)  # anywhere after the excerpt's title line

    def question(self, rng: random.Random, doc: "Document") -> str:
        title = doc.title
        package = title.split(":", 1)[0]
        if "package description" not in title:
            return f"Summarize the terms of the excerpt \"{title}\" in two sentences."
        form = rng.randrange(3)
        if form == 0:
            return f"What is {package} for? One sentence."
        if form == 1:
            return f"Name two features of {package} that its description mentions."
        return f"Using the excerpt \"{title}\", explain how to get started with {package}."

    def question_turn(self, question: str) -> str:
        return question
