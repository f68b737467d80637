//! A batch's result lines, typed: OpenAI's output (and error) file line (`ResultLine`), one per input line run,
//! keyed by `custom_id`; and Anthropic's Message Batch result line (`MessageResult`), its own view of the same.
//! Members are declared in name order, the order the `json!` maps they replace wrote keys in, so the files' bytes
//! are as they were.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// One line of a batch's output or error file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResultLine {
    pub custom_id: String,
    /// Always null: a line that ran has its answer (an error's included) in `response`.
    pub error: Option<Value>,
    pub id: String,
    pub response: LineResponse,
}

/// What a line's request answered: its status and body (JSON, or the text it was if not).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LineResponse {
    pub body: Value,
    pub request_id: String,
    pub status_code: u16,
}

impl ResultLine {
    pub fn new(custom_id: &str, request_id: &str, status: u16, body: &[u8]) -> ResultLine {
        let body: Value = serde_json::from_slice(body).unwrap_or_else(|_| json!(String::from_utf8_lossy(body)));
        ResultLine {
            custom_id: custom_id.into(),
            error: None,
            id: crate::ids::random_id("batch_req"),
            response: LineResponse { body, request_id: request_id.into(), status_code: status },
        }
    }

    pub fn succeeded(&self) -> bool {
        self.response.status_code == 200
    }

    /// The line as the file holds it (without its newline).
    pub fn to_text(&self) -> String {
        // Strings, numbers and JSON values only: serializing it cannot fail.
        serde_json::to_string(self).expect("a result line serializes")
    }
}

/// One line of a Message Batch's results: its request's `custom_id` and what became of it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MessageResult {
    pub custom_id: String,
    pub result: MessageOutcome,
}

/// `succeeded` with its Message, `errored` with its error, or `canceled` / `expired` for a request that never ran.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MessageOutcome {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<Value>,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

impl MessageOutcome {
    /// What a line that ran became.
    pub fn of(line: ResultLine) -> MessageOutcome {
        match line.succeeded() {
            true => MessageOutcome { error: None, message: Some(line.response.body), kind: "succeeded" },
            false => MessageOutcome { error: Some(line.response.body), message: None, kind: "errored" },
        }
    }

    /// A request that never ran: `canceled` or `expired`.
    pub fn never(kind: &'static str) -> MessageOutcome {
        MessageOutcome { error: None, message: None, kind }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_line_is_written_as_the_value_it_replaces() {
        for (status, body) in [(200, &br#"{"id":"x","choices":[]}"#[..]), (400, b"not json")] {
            let line = ResultLine::new("c-1", "batch_req_1", status, body);
            let body: Value = serde_json::from_slice(body).unwrap_or_else(|_| json!(String::from_utf8_lossy(body)));
            let was = json!({
                "id": line.id, "custom_id": "c-1",
                "response": {"status_code": status, "request_id": "batch_req_1", "body": body}, "error": null,
            });
            assert_eq!(line.to_text(), was.to_string());
            assert_eq!(serde_json::from_str::<ResultLine>(&line.to_text()).unwrap(), line);
            let outcome = MessageOutcome::of(line);
            let was = match status {
                200 => json!({"type": "succeeded", "message": body}),
                _ => json!({"type": "errored", "error": body}),
            };
            let got = MessageResult { custom_id: "c-1".into(), result: outcome };
            assert_eq!(serde_json::to_string(&got).unwrap(), json!({"custom_id": "c-1", "result": was}).to_string());
        }
        let never = MessageResult { custom_id: "c".into(), result: MessageOutcome::never("expired") };
        let was = json!({"custom_id": "c", "result": {"type": "expired"}});
        assert_eq!(serde_json::to_string(&never).unwrap(), was.to_string());
    }
}
