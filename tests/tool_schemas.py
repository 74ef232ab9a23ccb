"""The two functions the server tests call, as JSON schemas of their arguments; each API's
test wraps them in its own tool shape (OpenAI's chat, Anthropic's, OpenAI's Responses)."""

WEATHER_ARGUMENTS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_ARGUMENTS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 40}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER_TEXT = "The current weather in a city."
TIME_TEXT = "The local time in a time zone."
