//! A column's text as the polling query and the start-up read select it
//! (`column::text`), from the text pgoutput sends (the type's output
//! function).
//!
//! The two differ only for the built-in types whose cast to text is a
//! function of its own (`pg_cast` with `castmethod = 'f'`): `character(n)`
//! (`::text` drops the padding), `boolean` (`true`, not `t`) and `inet`
//! (`::text` always shows the mask: `10.0.0.1/32`). `"char"` and `name`
//! have such casts too, giving what their output functions give; every
//! other type, arrays of these three included (`{t,f}`, `{"a  "}`), is
//! cast by its output function. Without this, `aggregate_id char(10)` =
//! `42` would be `42` to polling and the start-up read but `42` and eight
//! spaces to the stream: another Kafka key and partition, and to the CDC
//! reader another aggregate, whose order and dead-letter block would not
//! hold across the two.
//!
//! Not covered: a domain over one of these types (pgoutput names the
//! domain's type, and `::text` casts as its base type does) and types of
//! extensions with a cast function to text of their own. The contract
//! columns cannot be of a domain (inspection refuses the type); an extra
//! or routing column of such a type keeps the output form in CDC.
//! See <https://www.postgresql.org/docs/current/catalog-pg-cast.html>.

/// `pg_type` OIDs, fixed for built-in types (`pg_type.dat`).
const BOOL: u32 = 16;
const INET: u32 = 869;
const BPCHAR: u32 = 1042;

/// How a column's output text becomes its `::text` form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextForm {
    /// The output text is the cast's.
    Output,
    /// `character(n)`: without the trailing spaces.
    Bpchar,
    /// `boolean`: `true` and `false` for `t` and `f`.
    Bool,
    /// `inet`: with the mask (`/32`, `/128`) where the output leaves it out.
    Inet,
}

impl TextForm {
    /// The form of a column of the type the Relation message names.
    pub fn of(type_oid: u32) -> Self {
        match type_oid {
            BPCHAR => TextForm::Bpchar,
            BOOL => TextForm::Bool,
            INET => TextForm::Inet,
            _ => TextForm::Output,
        }
    }

    /// The `::text` form of the output text `value`.
    pub fn text(self, value: &[u8]) -> String {
        match self {
            TextForm::Output => lossy(value),
            // rtrim of spaces alone, as the cast does: other trailing
            // whitespace is the value's own.
            TextForm::Bpchar => {
                let end = value.iter().rposition(|&b| b != b' ').map_or(0, |i| i + 1);
                lossy(&value[..end])
            }
            TextForm::Bool => match value {
                b"t" => "true".to_owned(),
                b"f" => "false".to_owned(),
                other => lossy(other),
            },
            TextForm::Inet => {
                let mut text = lossy(value);
                if !text.contains('/') {
                    // The output leaves out only a full mask.
                    text.push_str(if text.contains(':') { "/128" } else { "/32" });
                }
                text
            }
        }
    }
}

fn lossy(value: &[u8]) -> String {
    String::from_utf8_lossy(value).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pairs of (output function, `::text`), as PostgreSQL 15 gives them.
    #[test]
    fn output_text_becomes_the_text_cast() {
        let cases: &[(u32, &str, &str)] = &[
            (BPCHAR, "42        ", "42"),
            (BPCHAR, "          ", ""),
            (BPCHAR, "a b\t ", "a b\t"),
            (BPCHAR, "é  ", "é"),
            (BOOL, "t", "true"),
            (BOOL, "f", "false"),
            (INET, "10.0.0.1", "10.0.0.1/32"),
            (INET, "10.0.0.1/24", "10.0.0.1/24"),
            (INET, "::1", "::1/128"),
            (INET, "::ffff:1.2.3.4", "::ffff:1.2.3.4/128"),
            (INET, "2001:db8::/32", "2001:db8::/32"),
            // cidr always shows its mask; arrays are cast by their output.
            (650, "10.0.0.0/24", "10.0.0.0/24"),
            (1000, "{t,f}", "{t,f}"),
            (1014, "{\"a  \"}", "{\"a  \"}"),
            (25, "42        ", "42        "),
        ];
        for &(oid, output, cast) in cases {
            assert_eq!(
                TextForm::of(oid).text(output.as_bytes()),
                cast,
                "{oid} {output:?}"
            );
        }
    }
}
