"""Copy code (f10) finds code blocks with the Markdown parser: the cases a regex over fences missed."""
from mtpchat.app.chat import code_blocks, copyable_blocks


def test_plain_fences_in_order():
    text = "a\n```python\nx = 1\n```\nb\n~~~\ny = 2\n~~~\n"
    assert code_blocks(text) == ["x = 1\n", "y = 2\n"]


def test_a_fence_indented_in_a_list():
    text = "1. first\n\n   ```bash\n   pip install x\n   ```\n2. second\n"
    assert code_blocks(text) == ["pip install x\n"]


def test_a_longer_fence_holding_a_shorter_one():
    text = "````markdown\n```python\nprint(1)\n```\n````\n"
    assert code_blocks(text) == ["```python\nprint(1)\n```\n"]


def test_the_open_fence_of_a_stopped_reply():
    text = "Here is the code:\n\n```python\ndef f():\n    return"
    assert code_blocks(text) == ["def f():\n    return"]


def test_no_block_and_inline_code():
    assert code_blocks("just `inline` code and text") == []


def test_a_reply_of_bare_code_is_one_block_to_copy():
    # the demo model's replies are code without fences; the screen shows them as one code block
    text = "def clear(self, data):\n    \"\"\"Check if it is set.\"\"\"\n    return data\n"
    assert code_blocks(text) == []
    assert copyable_blocks(text) == [text]
    fenced = "Here:\n```python\nx = 1\n```\n"
    assert copyable_blocks(fenced) == code_blocks(fenced) == ["x = 1\n"]
