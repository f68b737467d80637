//! A batch's status as the store keeps it (the `status` column, and the Batch object's `status`): OpenAI's names,
//! the same text in both. The moves between them are the batch worker's (`workers::batches::status`).

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchStatus {
    Validating,
    Failed,
    InProgress,
    Finalizing,
    Completed,
    Expired,
    Cancelling,
    Cancelled,
}

/// A status column holding none of the statuses.
#[derive(Debug, thiserror::Error)]
#[error("unknown batch status '{0}'")]
pub struct UnknownStatus(pub String);

impl BatchStatus {
    pub const ALL: [BatchStatus; 8] = [
        Self::Validating,
        Self::Failed,
        Self::InProgress,
        Self::Finalizing,
        Self::Completed,
        Self::Expired,
        Self::Cancelling,
        Self::Cancelled,
    ];

    /// Its name, as the Batch object and the store's `status` column write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Validating => "validating",
            Self::Failed => "failed",
            Self::InProgress => "in_progress",
            Self::Finalizing => "finalizing",
            Self::Completed => "completed",
            Self::Expired => "expired",
            Self::Cancelling => "cancelling",
            Self::Cancelled => "cancelled",
        }
    }

    /// Whether the batch has ended: nothing runs it any more, and it moves no more.
    pub fn ended(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Cancelled | Self::Expired)
    }

    /// Whether the lifecycle moves a batch from this status to `to`.
    pub fn can_move_to(self, to: BatchStatus) -> bool {
        use BatchStatus::*;
        match self {
            Validating => matches!(to, InProgress | Failed | Cancelling),
            // Failed: it expired, or was cut short, and its results file did not fit.
            InProgress => matches!(to, Finalizing | Expired | Failed | Cancelling),
            Finalizing => matches!(to, Completed | Failed | Cancelling),
            Cancelling => matches!(to, Cancelled | Failed),
            Completed | Failed | Expired | Cancelled => false,
        }
    }
}

impl std::fmt::Display for BatchStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BatchStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|st| st.as_str() == s).ok_or_else(|| UnknownStatus(s.to_string()))
    }
}

/// The `status` column as a row reads it (`StoredBatch`): a text none of the statuses is the store's error.
impl TryFrom<String> for BatchStatus {
    type Error = UnknownStatus;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_reads_as_it_is_written() {
        for s in BatchStatus::ALL {
            assert_eq!(s.as_str().parse::<BatchStatus>().unwrap(), s);
            assert_eq!(BatchStatus::try_from(s.as_str().to_string()).unwrap(), s);
            assert_eq!(serde_json::to_value(s).unwrap(), serde_json::json!(s.as_str()));
        }
        assert!("canceled".parse::<BatchStatus>().is_err());
    }
}
