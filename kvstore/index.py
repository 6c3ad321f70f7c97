"""The page tree: which pages exist, how they chain, and token-granular prefix matching.

Pages are stored at page granularity but matched at token granularity (docs/design.md §3): full pages
are found by their chained key, one dict lookup each (vLLM's block hash), and at the first page
that does not match, the children of the last matched node are compared token by token, so the
longest shared run is reused even when it ends inside a page (SGLang's radix precision).

Invariants (asserted where they are cheap):
- every node but a root has a parent in the tree, and the parent is a *full* page: tail pages
  (fewer than `page_size` tokens) are always leaves;
- `node.key == page_key(parent.key, node.tokens)`; a node's tokens are compared on every match,
  so a hash collision is a miss, never wrong KV;
- a node is in the tree only while some tier holds it or it is being written (`ready` False);
  placement removes a node's whole subtree when its last copy goes, since a page whose parent
  is gone can never be matched again.

Roots are virtual, one per namespace (a model's namespace, or a chunk's namespace for
CacheBlend), hold no page and are never evicted. This module imports no torch, lmdb or aiohttp.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from os.path import commonprefix

from kvstore.keys import page_key

TOKEN_BYTES = 4  # tokens are kept as int32 little-endian bytes


class Node:
    __slots__ = ("key", "parent", "tokens", "children", "by_tokens", "kid_tokens", "tail_kids", "tiers", "tier_kids",
                 "pins", "ready", "last_access", "hits", "namespace", "depth", "tail", "root", "__weakref__")

    def __init__(self, key: bytes, parent: "Node | None", tokens: bytes, namespace: bytes):
        self.key = key
        self.parent = parent
        self.tokens = tokens  # int32 LE bytes of this page's tokens
        self.children: dict[bytes, Node] = {}
        self.by_tokens: dict[bytes, Node] = {}  # a child's tokens -> the child (siblings' tokens differ)
        # The children's tokens in byte order: the child sharing the longest run with some
        # tokens is next to where they would sort, so a partial match costs a binary search,
        # not a scan of every child (a root's children all start with the same BOS token).
        self.kid_tokens: list[bytes] = []
        self.tail_kids = 0  # children that are tail pages: the only ones a page's tokens can extend
        self.tiers: dict[str, int] = {}  # tier name -> bytes this page takes there
        self.tier_kids: dict[str, int] = {}  # tier name -> children held in that tier
        self.pins = 0  # > 0: a fetch or store is using the page; it is never evicted
        self.ready = True  # False while its first copy is being written
        self.last_access = 0  # logical clock, set by the store's clock
        self.hits = 0  # times served by a fetch (policies use it for frequency)
        self.namespace = namespace
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.root: Node = self if parent is None else parent.root  # its tree's root, O(1)
        self.tail = False  # a tail page: fewer tokens than a full page, the end of a sequence

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"Node({self.key.hex()[:8]}, tokens={self.num_tokens}, depth={self.depth}, tiers={list(self.tiers)})"


@dataclass
class Match:
    """The result of matching tokens against the tree.

    `path` is the chain of pages from the first page on; every page in it is used in full except
    possibly the last, of which `matched_tokens - (tokens before it)` are used.
    """

    root: Node | None  # None: the namespace holds no pages
    path: list[Node]
    matched_tokens: int



class PageIndex:
    """All pages of all namespaces: a dict by key plus the tree links."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, Node] = {}
        self.roots: dict[bytes, Node] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def root(self, root_key: bytes, namespace: bytes | None = None) -> Node:
        """The root of a tree: a model namespace's own, or a chunk's (`root_key` = chunk key)
        owned by the model namespace `namespace`."""
        node = self.roots.get(root_key)
        if node is None:
            node = self.roots[root_key] = Node(root_key, None, b"", namespace or root_key)
        return node

    def get(self, key: bytes) -> Node | None:
        return self.nodes.get(key)

    def match(self, namespace: bytes, tokens: bytes, page_size: int) -> Match:
        """Longest cached prefix of `tokens` (int32 LE bytes), at token granularity."""
        root = self.roots.get(namespace)
        if root is None:
            return Match(None, [], 0)
        page_bytes = page_size * TOKEN_BYTES
        path: list[Node] = []
        node = root
        offset = 0  # bytes of `tokens` matched so far
        total = len(tokens)
        # Full pages: one hash and one dict lookup each.
        while total - offset >= page_bytes:
            page = tokens[offset:offset + page_bytes]
            child = self.nodes.get(page_key(node.key, page))
            if child is None or not child.ready or child.parent is not node or child.tokens != page:
                break
            path.append(child)
            node = child
            offset += page_bytes
        # The first page that did not match: reuse the longest common run with any child
        # (a tail page, or a full page that diverges or is longer than what is left).
        if offset < total and node.kid_tokens:
            best, best_bytes = self.longest_child(node, tokens[offset:offset + page_bytes])
            if best is not None:
                path.append(best)
                offset += best_bytes
        return Match(root, path, offset // TOKEN_BYTES)

    @staticmethod
    def longest_child(node: Node, tokens: bytes) -> tuple[Node | None, int]:
        """The ready child of `node` whose tokens share the longest run of whole tokens with
        `tokens` (at most a page), and that run's length in bytes; (None, 0) if none shares one.

        In byte order, the run two strings share shrinks with their distance, so the best
        child is the nearest ready one on either side of where `tokens` would sort."""
        kids, by_tokens = node.kid_tokens, node.by_tokens
        at = bisect_left(kids, tokens)
        best, best_bytes = None, 0
        for side in (range(at, len(kids)), range(at - 1, -1, -1)):
            for i in side:
                child = by_tokens[kids[i]]
                common = len(commonprefix([kids[i], tokens])) // TOKEN_BYTES * TOKEN_BYTES
                if common <= best_bytes:
                    break  # only shorter runs lie further out
                if child.ready:
                    best, best_bytes = child, common
                    break
        return best, best_bytes

    @staticmethod
    def children_extending(node: Node, tokens: bytes) -> list[Node]:
        """`node`'s children whose tokens start with `tokens` (one of them may equal them)."""
        kids, by_tokens = node.kid_tokens, node.by_tokens
        out = []
        for i in range(bisect_left(kids, tokens), len(kids)):
            if not kids[i].startswith(tokens):
                break  # the ones that start with `tokens` sort together, right after it
            out.append(by_tokens[kids[i]])
        return out

    @staticmethod
    def children_prefixing(node: Node, tokens: bytes) -> list[Node]:
        """`node`'s children whose tokens are a proper prefix of `tokens` (shorter tails)."""
        if not node.tail_kids:  # a proper prefix of a page is shorter than a page: a tail
            return []
        by_tokens = node.by_tokens
        if len(by_tokens) * TOKEN_BYTES <= len(tokens):  # few children: look at each
            return [kid for t, kid in by_tokens.items() if len(t) < len(tokens) and tokens.startswith(t)]
        found = (by_tokens.get(tokens[:end]) for end in range(TOKEN_BYTES, len(tokens), TOKEN_BYTES))
        return [kid for kid in found if kid is not None]

    def insert(self, parent: Node, key: bytes, tokens: bytes, *, tail: bool = False) -> Node:
        """Add a page under `parent` (not yet ready: the caller marks it ready once written).
        `tail`: the page holds fewer tokens than a full page (policies may rank it apart)."""
        nodes, by_tokens = self.nodes, parent.by_tokens
        assert key not in nodes, "insert of an existing key"
        assert parent.parent is None or parent.tokens, "a page's parent is a page or a root"
        assert tokens not in by_tokens, "two siblings with the same tokens"
        node = Node(key, parent, tokens, parent.namespace)
        node.ready = False
        node.tail = tail
        parent.tail_kids += tail
        nodes[key] = node
        parent.children[key] = node
        by_tokens[tokens] = node
        insort(parent.kid_tokens, tokens)  # siblings' tokens differ: its place is bisect_left's
        if parent.parent is None and len(parent.children) == 1:
            # A root's first page. The root may have been let go since the caller took it (the
            # room for this page evicted the tree's last page, `unlink`): it is the tree's again.
            self.roots.setdefault(parent.key, parent)
        return node

    def unlink(self, node: Node) -> None:
        """Remove one page (which must have no children left) from the tree."""
        assert not node.children, "unlink of a page that still has children"
        assert not node.tiers, "unlink of a page still held by a tier"
        key, tokens = node.key, node.tokens
        del self.nodes[key]
        parent = node.parent
        if parent is not None:
            children = parent.children
            del children[key]
            del parent.by_tokens[tokens]
            parent.tail_kids -= node.tail
            kids = parent.kid_tokens
            del kids[bisect_left(kids, tokens)]
            if parent.parent is None and not children:  # a root left without pages
                self.roots.pop(parent.key, None)

    def subtree(self, node: Node) -> list[Node]:
        """`node` and all its descendants, children before parents (safe order to unlink)."""
        if not node.children:  # most pages dropped are leaves
            return [node]
        out: list[Node] = []
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if expanded or not current.children:
                out.append(current)
            else:
                stack.append((current, True))
                stack.extend((child, False) for child in current.children.values())
        return out
