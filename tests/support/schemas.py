"""JSON schemas the tests constrain replies with."""

# Bounded everywhere, so that even a random model's greedy reply must end inside max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "address", "ok"],
    "additionalProperties": False,
}
