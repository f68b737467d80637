//! The `limits!` macro: one declaration per limit (name, type, default, flag or none, unit, group, help) turned
//! into the `Limits` record the launcher hands over, its defaults (`Limits::DEFAULT`), the fixed limits' constants,
//! and the `Limit` records `_native.LIMITS` exports for Python's flags and the README's check.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// `settable { /// help.. name: type = default, "--flag", Unit, group [, derived "what the launcher puts"]; }`
/// `fixed { /// help.. NAME: type = value, Unit; }`. A settable limit's help is its flag's `--help` text.
macro_rules! limits {
    (
        settable {
            $( $(#[doc = $doc:literal])+
               $field:ident: $ty:ty = $default:expr, $flag:literal, $unit:ident, $group:ident
               $(, derived $derived:literal)?; )+
        }
        fixed {
            $( $(#[doc = $fdoc:literal])+ $name:ident: $fty:ty = $value:expr, $funit:ident; )+
        }
    ) => {
        crate::py_record::py_record! {
            /// The limits an operator sets by flag, as the launcher hands them over (every one, always: no
            /// default here but `DEFAULT`, which is the flags' own).
            #[derive(Debug, Clone)]
            pub struct Limits {
                $( $(#[doc = $doc])+ pub $field: $ty, )+
            }
        }

        impl Limits {
            /// The flags' defaults; a `derived` one is the launcher's to work out, and this its value in tests.
            pub const DEFAULT: Limits = Limits { $( $field: $default, )+ };
        }

        $( $(#[doc = $fdoc])+ pub const $name: $fty = $value; )+

        /// Every limit as a record, settable ones first, in the order declared.
        pub fn declared(py: pyo3::Python<'_>) -> pyo3::PyResult<Vec<Limit>> {
            use pyo3::IntoPyObjectExt;
            Ok(vec![
                $( Limit {
                    name: stringify!($field),
                    flag: Some($flag),
                    default: Limits::DEFAULT.$field.into_py_any(py)?,
                    unit: Unit::$unit.name(),
                    group: Some(stringify!($group)),
                    help: help(&[$($doc),+]),
                    derived: None $(.or(Some($derived)))?,
                }, )+
                $( Limit {
                    name: stringify!($name),
                    flag: None,
                    default: $name.into_py_any(py)?,
                    unit: Unit::$funit.name(),
                    group: None,
                    help: help(&[$($fdoc),+]),
                    derived: None,
                }, )+
            ])
        }
    };
}

pub(super) use limits;

/// A doc comment's lines as one paragraph.
pub(super) fn help(lines: &[&str]) -> String {
    lines.iter().map(|l| l.trim()).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// What a limit counts: the metavar of its flag, and the unit of its README default.
#[derive(Clone, Copy)]
pub enum Unit {
    Bytes,
    Count,
    Seconds,
}

impl Unit {
    pub fn name(self) -> &'static str {
        match self {
            Unit::Bytes => "bytes",
            Unit::Count => "count",
            Unit::Seconds => "seconds",
        }
    }
}

/// One declared limit, as Python reads it (`_native.LIMITS`): `limits_args` builds the flags from the settable
/// ones (`flag` set), the launcher sends back a dict of every settable one by `name`, and a test checks the
/// README's options table against `default`.
#[pyclass(name = "Limit", module = "deepinfer_server._native", frozen, get_all)]
pub struct Limit {
    /// The field of `Limits` (settable), or the constant (fixed).
    pub name: &'static str,
    /// `--flag`; `None` for a limit no flag sets.
    pub flag: Option<&'static str>,
    /// An `int` or a `float`, as the limit's type: the flag's type too.
    pub default: Py<PyAny>,
    /// `bytes`, `count` or `seconds`.
    pub unit: &'static str,
    /// The argument group of `--help` the flag is listed under: `limits`, `media` or `state`.
    pub group: Option<&'static str>,
    pub help: String,
    /// What the launcher puts when the flag is not given, when that is not `default` (then the flag's Python
    /// default is `None`).
    pub derived: Option<&'static str>,
}

/// `LIMITS`: the declared limits, a tuple of `Limit`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Limit>()?;
    let records = super::declared(m.py())?.into_iter().map(|l| Py::new(m.py(), l)).collect::<PyResult<Vec<_>>>()?;
    m.add("LIMITS", PyTuple::new(m.py(), records)?)
}
